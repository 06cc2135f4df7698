"""A store that outlives DiLoCo islands: `python -m dragon.diloco.island_store --port P`.

Islands launched separately meet through a TCPStore at --diloco_store HOST:PORT, by default
hosted by island 0's first rank, so the run ends with island 0. Elastic islands need a store that
outlives any island: run this on a machine they all reach, start them with `--diloco_store HOST:P
--diloco_store_external`, and stop it (Ctrl-C, SIGTERM) after the run. It keeps quorums by outer
step, so a restart of every island needs a fresh store; islands that --diloco_join keep it."""

import argparse
import os
import signal
from datetime import timedelta

import torch.distributed as dist


def serve(host: str, port: int) -> dist.TCPStore:
    """Host the store (returns it: it serves while the object lives)."""
    return dist.TCPStore(
        host, port, world_size=None, is_master=True, timeout=timedelta(days=30),
        wait_for_workers=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, required=True, help="port to listen on")
    args = parser.parse_args()
    if not 0 < args.port < 65536:
        parser.error(f"--port {args.port}: must be in 1-65535")
    # Serve until SIGTERM or SIGINT, blocked in every thread (the store's too) and waited for here.
    stops = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stops)
    store = serve(args.host, args.port)
    print(f"dragon island store listening on {args.host}:{args.port}", flush=True)
    signal.sigwait(stops)
    del store  # closes its socket


if __name__ == "__main__":
    main()
    os._exit(0)  # the store held no other state: skip the interpreter's teardown of torch
