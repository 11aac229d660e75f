"""A Redis connection that cannot be opened because this process has no file descriptor
left says so: StoreUnavailable names the local limit, not Redis going away
(docs/dispatch.md#out-of-open-files)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from urllib.parse import urlsplit

# Run in a child process: it uses up its own file descriptors, not the test runner's.
CHILD = textwrap.dedent(
    """
    import resource, socket, sys
    import trio
    from claimkit.store import StoreUnavailable, open_store

    async def main(url):
        async with open_store(url, timeout=5) as ready:
            await ready.command("PING")  # Redis answers
            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            held = []
            try:
                while True:
                    held.append(socket.socket())
            except OSError:
                pass
            async with open_store(url, timeout=5) as store:  # a connection of its own
                try:
                    await store.command("PING")
                except StoreUnavailable as exc:
                    print(exc)

    trio.run(main, sys.argv[1])
    """
)


def test_out_of_files_names_the_local_limit(redis_url: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, redis_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    address = urlsplit(redis_url).netloc.rpartition("@")[2]
    assert result.stdout == (
        f"Unable to establish a connection to {address} "
        "(too many open files: this process's open-file limit, not Redis)\n"
    )
