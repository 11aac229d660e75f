"""The ``claimkit`` command line (docs/cli.md): one typer app.

``serve``, ``submit``, ``sim`` and ``demo`` live here; the operator commands (``inspect``,
``drain``, ``pause``, ``resume``, ``reclaim``, ``dead``, ``results``, ``cancel``) in
:mod:`claimkit.cli.ops_commands`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from importlib.metadata import version as package_version
from typing import TYPE_CHECKING, Annotated, Any

import typer

from claimkit.cli.common import (
    Interrupt,
    QueueName,
    RedisUrl,
    TransportConfig,
    TransportConfigFile,
    config_from,
    fail,
    flow_help,
    run_to_end,
    usage_error,
)
from claimkit.protocol.consumers import default_consumer_id
from claimkit.protocol.tokens import consumer_id_problem

if TYPE_CHECKING:
    from claimkit.store import Store

app = typer.Typer(
    name="claimkit",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain click help: paragraphs flow to the terminal width, examples stay verbatim
    # (flow_help marks them), flags show no metavar, and no rich markup eats "[...]".
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"claimkit {package_version('claimkit')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print claimkit's version (from the installed package) and exit.",
        ),
    ] = False,
) -> None:
    """Durable peek -> claim -> ack consumer for Redis sorted-set LLM inference queues.

    Every command, its options and its exit status: docs/cli.md.
    """


def _consumer_id_source(ctx: typer.Context) -> str:
    """Where serve's consumer id came from, as an error names it: ``--consumer-id``,
    ``$CLAIMKIT_CONSUMER_ID``, ``$POD_NAME`` or the host name (``<host>-<pid>``)."""
    source = getattr(ctx.get_parameter_source("consumer_id"), "name", None)
    if source == "COMMANDLINE":
        return "--consumer-id"
    if source == "ENVIRONMENT":
        return "$CLAIMKIT_CONSUMER_ID"
    if os.environ.get("POD_NAME"):
        return "$POD_NAME"
    return "the default consumer id (<host name>-<pid>)"


@app.command()
def serve(
    ctx: typer.Context,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
    redis_url: RedisUrl = None,
    claim_lease_ttl: Annotated[
        float | None, typer.Option(help="Lease length, seconds (default 300).", show_default=False)
    ] = None,
    claim_reclaim_interval: Annotated[
        int | None,
        typer.Option(help="Reclaimer period, milliseconds (default 15000).", show_default=False),
    ] = None,
    result_dedup_ttl: Annotated[
        int | None,
        typer.Option(
            help="Dedup marker TTL, seconds; 0 = never expire (default 21600).", show_default=False
        ),
    ] = None,
    concurrency: Annotated[
        int | None,
        typer.Option(help="Requests in flight at once (default 64).", show_default=False),
    ] = None,
    request_timeout: Annotated[
        float | None,
        typer.Option(
            help="Per-attempt HTTP timeout cap, seconds (default 300).", show_default=False
        ),
    ] = None,
    drain_timeout: Annotated[
        float | None,
        typer.Option(
            help="Grace for in-flight requests on SIGTERM, seconds (default 10).",
            show_default=False,
        ),
    ] = None,
    metrics_port: Annotated[
        int | None,
        typer.Option(help="/metrics port; 0 turns it off (default 9090).", show_default=False),
    ] = None,
    health_port: Annotated[
        int | None,
        typer.Option(
            help="/healthz and /readyz port; 0 turns it off (default 8081).", show_default=False
        ),
    ] = None,
    http_host: Annotated[
        str | None,
        typer.Option(
            help="IP address the metrics and health servers bind, e.g. 127.0.0.1 or :: "
            "(default 0.0.0.0, every IPv4 interface: Kubernetes probes reach the pod IP).",
            show_default=False,
        ),
    ] = None,
    http_idle_timeout: Annotated[
        float | None,
        typer.Option(
            help="Seconds an HTTP connection may stay open without a complete request (default 5).",
            show_default=False,
        ),
    ] = None,
    http_max_connections: Annotated[
        int | None,
        typer.Option(
            help="HTTP connections open at once over both servers; past it, a new one closes "
            "the oldest (default 512).",
            show_default=False,
        ),
    ] = None,
    consumer_id: Annotated[
        str | None,
        typer.Option(
            envvar="CLAIMKIT_CONSUMER_ID",
            metavar="ID",
            help="This consumer's id, 1-127 of [A-Za-z0-9._-]: the first part of every "
            "claim's token and its name in `claimkit consumers` (default "
            "$CLAIMKIT_CONSUMER_ID, else $POD_NAME, else <host>-<pid>; "
            "docs/cli.md#claimkit-serve).",
            show_default=False,
        ),
    ] = None,
    consumer_liveness_ttl: Annotated[
        float | None,
        typer.Option(
            metavar="SECONDS",
            help="Seconds a consumer's liveness entry outlives its last heartbeat; once it "
            "lapses, any reclaimer hands its claims on. 0 turns the registry off (default "
            "10; docs/operations.md#consumers).",
            show_default=False,
        ),
    ] = None,
    store_backend: Annotated[
        str, typer.Option("--store", help="Redis client: coredis, or redispy (optional extra).")
    ] = "coredis",
    log_level: Annotated[str, typer.Option(help="Python logging level.")] = "INFO",
    allow_eviction: Annotated[
        bool,
        typer.Option(
            "--allow-eviction",
            help="Serve even when Redis's maxmemory-policy can evict any key (allkeys-*): "
            'a warning instead of the refusal (docs/operations.md, "Eviction").',
        ),
    ] = False,
) -> None:
    """Consume every configured queue until SIGTERM or SIGINT.

    Peeks, claims, sends each request to its gateway and acks its terminal record
    (docs/protocol.md, docs/dispatch.md). On SIGTERM claiming stops, in-flight requests
    get --drain-timeout to finish, and every claim still held is swept back to pending.
    A second signal skips the wait. Ends with one summary line (docs/cli.md). The
    configuration: docs/configuration.md; the metrics: docs/metrics.md.

    Example:

        claimkit serve --redis-url redis://127.0.0.1:6379/0 \\
          --transport-config-file transport.json
    """
    if consumer_id is None:
        consumer_id = default_consumer_id()  # $POD_NAME, else <host>-<pid>
    problem = consumer_id_problem(consumer_id)
    if problem is not None:
        usage_error(f"{_consumer_id_source(ctx)}: {problem}")
    config = config_from(
        transport_config,
        transport_config_file,
        redis_url,
        claim_lease_ttl_seconds=claim_lease_ttl,
        claim_reclaim_interval_ms=claim_reclaim_interval,
        result_dedup_ttl_seconds=result_dedup_ttl,
        concurrency=concurrency,
        request_timeout_seconds=request_timeout,
        drain_timeout_seconds=drain_timeout,
        metrics_port=metrics_port,
        health_port=health_port,
        http_host=http_host,
        http_idle_timeout_seconds=http_idle_timeout,
        http_max_connections=http_max_connections,
        consumer_id=consumer_id,
        consumer_liveness_ttl_seconds=consumer_liveness_ttl,
    )
    if store_backend not in ("coredis", "redispy"):
        usage_error(f"--store must be coredis or redispy, got {store_backend!r}")
    if log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        usage_error(
            f"--log-level must be DEBUG, INFO, WARNING, ERROR or CRITICAL, got {log_level!r}"
        )
    logging.basicConfig(
        level=log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    # One line per HTTP request would drown the consumer's own lines, and coredis logs
    # every broken connection at INFO with a traceback; the consumer already says in one
    # line that Redis went away and that it answers again. --log-level DEBUG shows both.
    if log_level.upper() != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)
        logging.getLogger("coredis").setLevel(logging.WARNING)
    from claimkit.consumer.serve import serve_forever

    summary = run_to_end(
        lambda: serve_forever(config, backend=store_backend, allow_eviction=allow_eviction),
        url=config.url,
    )
    typer.echo(summary.line())


def _no_constant(name: str) -> Any:
    """``json.loads`` accepts ``NaN`` and ``Infinity``; JSON (and the consumer) does not."""
    raise ValueError(f"{name} is not a JSON value")


def _parse_request(line: str, n: int | None) -> Any:
    """One request's JSON, or exit with one line naming line ``n`` (``None``: the argument)."""
    bad = "the request is not valid JSON" if n is None else f"line {n}: not valid JSON"
    try:
        return json.loads(line, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        fail(f"{bad}: {exc.msg} at column {exc.colno}")
    except ValueError as exc:  # NaN/Infinity, or an int of more digits than Python converts
        fail(f"{bad}: {exc}".split(";")[0])
    except RecursionError:
        fail(f"{bad}: nested too deeply")


@app.command()
def submit(
    request: Annotated[
        str | None,
        typer.Argument(
            help="One JSON request; omit to read one JSON request per line from --file/stdin."
        ),
    ] = None,
    queue: QueueName = "request-sortedset",
    file: Annotated[
        typer.FileText | None,
        typer.Option("--file", "-f", help="File of JSON lines ('-' = stdin)."),
    ] = None,
    payload_ref: Annotated[
        bool,
        typer.Option(
            "--payload-ref",
            help="Store each payload apart, at request-payload:<id>:<token>, and queue a "
            "member that names it (docs/protocol.md#payload-references).",
        ),
    ] = False,
    redis_url: RedisUrl = None,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
) -> None:
    """Submit requests: a `data` object or a whole envelope per request.

    Each needs `id` and `deadline` (integer Unix seconds, in the future, at most
    253402300799) and must be a request the consumer would serve: it is checked with the
    consumer's own parser before anything is written. With --file/stdin, one request per
    line (blank lines are skipped); all are submitted in one atomic call, or none when any
    line is refused, and the refused line is named by its number. Requests of one deadline
    are served in the order submitted. With --payload-ref each payload is stored under its
    own key and the queued member carries "payload":null and the key's name, for consumers
    that read payload references. Prints one request token per request; an input with no
    requests prints a note on stderr and exits 0. The request format: docs/protocol.md.

    Examples:

        claimkit submit -q requests \\
          '{"id":"r1","deadline":1893456000,"payload":{"prompt":"hi"}}'

        claimkit submit -q requests -f requests.jsonl

        claimkit submit -q requests --payload-ref -f requests.jsonl
    """
    config = config_from(transport_config, transport_config_file, redis_url, require_queues=False)
    if request is not None and file is not None:
        usage_error("give one JSON request or --file, not both")
    numbered: list[tuple[int, str]]
    if request is not None:
        numbered = [(1, request)]
    else:
        try:
            numbered = [(n, line) for n, line in enumerate(file or sys.stdin, 1) if line.strip()]
        except UnicodeDecodeError as exc:
            fail(f"the input is not UTF-8 text: {exc.reason} at byte {exc.start}")
    from_lines = request is None

    def where(n: int) -> str:
        return f"line {n}: " if from_lines else ""

    docs = [_parse_request(line, n if from_lines else None) for n, line in numbered]
    if not docs:
        sys.stderr.write("claimkit: nothing submitted: the input holds no requests\n")
        return

    from claimkit.cli.runner import with_store
    from claimkit.producer import Producer, SubmitError

    async def go(store: Store) -> list[str]:
        try:
            producer = Producer(
                store,
                queue,
                payload_refs=payload_ref,
                wait_replicas=config.wait_replicas,
                wait_timeout_ms=config.wait_timeout_ms,
            )
            return await producer.submit_many(docs)
        except SubmitError as exc:
            if exc.index is None:
                raise
            raise SubmitError(f"{where(numbered[exc.index][0])}{exc}") from None

    for token in with_store(config, go, interrupt=Interrupt.RAISE):
        typer.echo(token)


@app.command()
def sim(
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    latency: Annotated[
        str, typer.Option(help="Seconds per answer: '0.05' or a uniform range '0.01,0.2'.")
    ] = "0",
    rate_429: Annotated[float, typer.Option("--rate-429", help="Share of 429 answers.")] = 0.0,
    rate_5xx: Annotated[float, typer.Option("--rate-5xx", help="Share of 503 answers.")] = 0.0,
    rate_hang: Annotated[float, typer.Option(help="Share of requests never answered.")] = 0.0,
    retry_after: Annotated[
        str | None, typer.Option(help="Retry-After value sent with 429s.", show_default=False)
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Random seed.", show_default=False)] = None,
) -> None:
    """Run the OpenAI-compatible gateway simulator (a development tool, not a model).

    Example:

        claimkit sim --port 8000 --latency 0.01,0.1 --rate-429 0.05
    """
    from claimkit.dev.sim import SimConfig, parse_latency, run_sim_forever

    try:
        config = SimConfig(
            host=host,
            port=port,
            latency=parse_latency(latency),
            rate_429=rate_429,
            rate_5xx=rate_5xx,
            rate_hang=rate_hang,
            retry_after=retry_after,
            seed=seed,
        )
    except ValueError as exc:
        usage_error(str(exc))
    try:
        run_sim_forever(config)
    except OSError as exc:
        reason = (exc.strerror or str(exc)).lower()
        fail(f"cannot listen on {host}:{port}: {reason}; pass another --port, or 0 for a free one")


@app.command()
def demo(
    requests: Annotated[int, typer.Option(help="How many requests to submit.")] = 300,
    keep: Annotated[bool, typer.Option(help="Keep the temp dir (Redis AOF, logs).")] = False,
) -> None:
    """Run the durability demo: one of two consumers is SIGKILLed holding claims; lost = 0.

    It starts a private Redis (AOF appendfsync always) and the simulator, submits requests,
    runs two consumers, SIGKILLs one while it holds claims, and ends with a summary where
    lost must be 0. Exit status 0 only then. Every process it started is stopped.

    Example:

        claimkit demo --requests 300
    """
    from claimkit.dev import DevExtraMissing

    try:
        from claimkit.dev.demo import run_demo
    except DevExtraMissing as exc:  # only that: any other ImportError is a bug and surfaces
        fail(str(exc))
    raise typer.Exit(run_demo(requests=requests, keep=keep))


@app.command("acl")
def acl(
    role: Annotated[
        list[str] | None,
        typer.Option(
            "--role",
            metavar="ROLE",
            help="consumer (serve), producer (submit, cancel, results) or operator; "
            "repeat for several (default: all three).",
            show_default=False,
        ),
    ] = None,
    user: Annotated[
        str | None,
        typer.Option(
            metavar="NAME", help="ACL user name (default: claimkit-<role>).", show_default=False
        ),
    ] = None,
    queue: Annotated[
        list[str] | None,
        typer.Option(
            "--queue",
            "-q",
            metavar="QUEUE",
            help="A queue the config does not list (repeatable).",
            show_default=False,
        ),
    ] = None,
    result_list: Annotated[
        list[str] | None,
        typer.Option(
            "--result-list",
            metavar="LIST",
            help="A result list requests route to themselves (repeatable).",
            show_default=False,
        ),
    ] = None,
    rule_only: Annotated[
        bool, typer.Option("--rule-only", help="Print only the rule, for an ACL file.")
    ] = False,
    transport_config: TransportConfig = None,
    transport_config_file: TransportConfigFile = None,
) -> None:
    """Print the narrowest Redis ACL rule each role needs for a config (docs/security.md).

    One `ACL SETUSER` line per role: the commands it sends (its Lua scripts' included) and
    a ~pattern for every key the config makes it touch. Connects to nothing. Add the
    password yourself (`>password` in the line, or `user ... >password <rule>` in an ACL
    file).

    Example:

        claimkit acl --role consumer --transport-config-file transport.json
    """
    from claimkit.ops.acl import ROLES, acl_rule

    config = config_from(
        transport_config,
        transport_config_file,
        None,
        require_queues=False,
        url="redis://claimkit-acl.invalid",
    )
    roles = role or list(ROLES)
    unknown = [name for name in roles if name not in ROLES]
    if unknown:  # before any rule is printed: a usage mistake prints nothing else
        usage_error(f"unknown --role {unknown[0]!r}: choose from {', '.join(ROLES)}")
    for name in roles:
        try:
            rule = acl_rule(config, name, queues=queue or (), extra_lists=result_list or ())
        except ValueError as exc:
            fail(str(exc))
        typer.echo(rule.rule() if rule_only else rule.setuser(user or f"claimkit-{name}"))


def _register_operator_commands() -> None:
    # The operator commands register after serve, submit and the rest, so they are listed
    # last. An ImportError here is a packaging bug: it must surface, not hide five commands.
    from claimkit.cli.ops_commands import register

    register(app)


_register_operator_commands()
flow_help(app)


def main() -> None:
    """Entry point of the ``claimkit`` script."""
    # SIGPIPE stays ignored (Python's default): restoring SIG_DFL would let any peer that
    # closes a socket mid-write kill `serve` or `sim` outright. A closed stdout
    # (`claimkit results | head`) is handled here instead.
    try:
        app()
    except BrokenPipeError:
        # Point stdout at devnull so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        sys.exit(1)


__all__ = ["app", "main"]
