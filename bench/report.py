"""Print the tables of docs/performance.md from the JSON the benchmarks wrote.

    python bench/report.py [--results bench/results]

Reads ``peers-full.json`` (the peers harness run with claimkit added, if present),
``dispatch_paths.json`` and ``protocol.json``; prints Markdown tables and the headline ratios.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

LABELS = {
    "bullmq": "BullMQ (Node)",
    "arq": "arq",
    "arq-poll0": "arq (poll_delay=0)",
    "saq": "SAQ",
    "rq": "RQ",
    "calib-coredis": "calib: trio + coredis + httpx, no claims",
    "claimkit": "**claimkit** (coredis)",
    "claimkit-redispy": "**claimkit** (redis-py via trio-asyncio)",
}
PY_PEERS = ("saq", "arq", "arq-poll0", "rq")


def peers_tables(doc: dict[str, Any]) -> list[str]:
    out = [
        f"Command: `{doc['meta']['command']}` ({doc['meta']['date']}, "
        f"{doc['meta']['elapsed_min']:.0f} min)",
        "",
    ]
    rows = doc["rows"]
    for workload in ("http", "noop"):
        for aof in ("off", "everysec"):
            sel = [r for r in rows if r["workload"] == workload and r["aof"] == aof and r["good"]]
            if not sel:
                continue
            out += [
                f"**{workload}, AOF {aof}** (median of good runs, min-max)",
                "",
                "| system | jobs/s | min-max | worker CPU ms/job | scripts/job | "
                "Redis cmds/job | Redis CPU ms/job | good runs |",
                "|---|---:|---:|---:|---:|---:|---:|---:|",
            ]
            for r in sorted(sel, key=lambda r: -r["rate_med"]):
                out.append(
                    f"| {LABELS.get(r['system'], r['system'])} | {r['rate_med']:,.0f} | "
                    f"{r['rate_min']:,.0f}-{r['rate_max']:,.0f} | {r['cpu_per_1k']:.2f} | "
                    f"{r['scripts_per_job']:.2f} | {r['cmds_per_job']:.1f} | "
                    f"{r['redis_cpu_per_1k']:.3f} | {r['good']}/{r['runs']} |"
                )
            out.append("")
    return out


def headline(doc: dict[str, Any]) -> list[str]:
    out = []
    for aof in ("off", "everysec"):
        rows = {
            r["system"]: r
            for r in doc["rows"]
            if r["workload"] == "http" and r["aof"] == aof and r["good"]
        }
        ck = rows.get("claimkit")
        if not ck:
            continue
        best = max(
            (rows[s] for s in PY_PEERS if s in rows), key=lambda r: r["rate_med"], default=None
        )
        parts = [f"AOF {aof}: claimkit {ck['rate_med']:,.0f} jobs/s"]
        if best:
            parts.append(
                f"{ck['rate_med'] / best['rate_med']:.2f}x the best Python peer "
                f"({LABELS[best['system']]}, {best['rate_med']:,.0f})"
            )
        if "bullmq" in rows:
            parts.append(
                f"{ck['rate_med'] / rows['bullmq']['rate_med']:.2f}x BullMQ "
                f"({rows['bullmq']['rate_med']:,.0f})"
            )
        if "calib-coredis" in rows:
            parts.append(
                f"{ck['rate_med'] / rows['calib-coredis']['rate_med']:.2f}x the "
                f"no-claims calibration loop"
            )
        if "claimkit-redispy" in rows:
            parts.append(f"redis-py backend {rows['claimkit-redispy']['rate_med']:,.0f} jobs/s")
        out.append("- " + "; ".join(parts))
    return out


def dispatch_table(doc: dict[str, Any]) -> list[str]:
    out = [
        f"{len(next(iter(doc['runs'].values())))} runs each, n={doc['n']}, "
        f"concurrency={doc['concurrency']}; median (min-max)",
        "",
        "| client | requests/s | CPU ms/request |",
        "|---|---:|---:|",
    ]
    for r in doc["summary"]:
        out.append(
            f"| {r['client']} | {r['rps_median']:,.0f} ({r['rps_min']:,.0f}-"
            f"{r['rps_max']:,.0f}) | {r['cpu_ms_median']:.3f} ({r['cpu_ms_min']:.3f}-"
            f"{r['cpu_ms_max']:.3f}) |"
        )
    return out


def protocol_tables(doc: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if "calls" in doc:
        out += [
            "| batch_size | scripts/request | round trips/request | jobs/s (http) | "
            "worker CPU ms/request |",
            "|---:|---:|---:|---:|---:|",
        ]
        for r in doc["calls"]:
            out.append(
                f"| {r['batch']} | {r['scripts_per_req']:.3f} | "
                f"{r['round_trips_per_req']:.3f} | {r['jobs_s']:,.0f} | "
                f"{r['cpu_ms_per_req']:.3f} |"
            )
        out.append("")
    if "ceiling" in doc:
        c = doc["ceiling"]
        out += [
            f"Ceiling ({c['loops']} Python loops of peek + claim + ack, batch {c['batch']}): "
            f"{c['jobs_s']:,.0f} jobs/s; Redis script time {c['redis_script_usec_per_job']:.1f}"
            f" us/job, so Redis alone would allow ~{c['redis_bound_jobs_s']:,.0f} jobs/s.",
            "",
        ]
    if "backlog" in doc:
        b = doc["backlog"]
        out += [
            f"Backlog: {b['1000']['claims_s']:,.0f} claims/s with 1k pending, "
            f"{b['1000000']['claims_s']:,.0f} with 1M pending (ratio {b['ratio']:.2f}); "
            f"claim script {b['1000']['claim_script_usec_per_call']:.0f} vs "
            f"{b['1000000']['claim_script_usec_per_call']:.0f} us/call.",
            "",
        ]
    if "heartbeat" in doc:
        h = doc["heartbeat"]
        out += [
            f"Heartbeat, {h['held']:,} claims held: {h['calls_per_tick']:.0f} calls/tick, "
            f"{h['redis_usec_per_tick'] / 1000:.1f} ms Redis time/tick, slowest single "
            f"script {h['slowest_script_usec'] / 1000:.2f} ms, wall "
            f"{h['wall_ms_per_tick']:.0f} ms.",
            "",
        ]
    if "scale" in doc:
        out += ["| consumer processes | jobs/s (http) |", "|---:|---:|"]
        out += [f"| {r['processes']} | {r['jobs_s']:,.0f} |" for r in doc["scale"]]
        out.append("")
    if "recovery" in doc:
        r = doc["recovery"]
        runs = ", ".join(f"{x:.2f}" for x in r["runs"])
        out += [
            f"Recovery: {r['seconds']:.2f} s from SIGKILL to the first redelivered result "
            f"(lease {r['lease_s']} s, reclaim every {r['reclaim_interval_ms']} ms, gateway "
            f"latency {r['gateway_latency_s']} s; runs {runs}).",
            "",
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args()
    res = Path(args.results)
    lines: list[str] = []
    if (res / "peers-full.json").exists():
        doc = json.loads((res / "peers-full.json").read_text())
        lines += ["## Side by side (peers harness)", "", *peers_tables(doc)]
        lines += ["## Headline", "", *headline(doc), ""]
    if (res / "dispatch_paths.json").exists():
        lines += ["## HTTP client alone", ""]
        lines += [*dispatch_table(json.loads((res / "dispatch_paths.json").read_text())), ""]
    if (res / "protocol.json").exists():
        protocol = json.loads((res / "protocol.json").read_text())
        lines += ["## Protocol", "", *protocol_tables(protocol)]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
