"""Where a KV transfer's time goes: raw NIXL WRITEs against ``KVTransport.write``, two processes.

    python -m tools.bench.kv_probe [--sizes-mb 1.5,7,53] [--repeat 20] \\
        [--tls "all;tcp,cma"] [--receiver-poll-s S] [--error-handling none|peer] \\
        [--progress-thread] [--huge-pages]

For each UCX transport choice (``UCX_TLS``, ``;`` between them; ``all`` is UCX's default) a
fresh pair of processes: a receiver that registers a pool the shape of the default model's
(30 layers, 24 KiB pages) and polls for notifications, and a sender with the same pool. Per
size, timed on the sender, best and median of ``--repeat`` after one untimed warm-up:

- ``raw``: one descriptor per layer, lists prepared once, one transfer handle made once and
  posted again each time, polled without sleeping (the most NIXL can do here);
- ``quiet``: the same handle made without a notification (the copy alone: no completion
  waits for the receiver);
- ``ours``: ``KVTransport.write`` as the prefill executor calls it (page lists prepared once,
  page indices per transfer), pages in one run per layer;
- ``ours_scattered``: the same with every other page, so no two pages merge;
- ``unprepared``: what the transport did before, descriptor lists of merged extents built and
  a transfer initialized per request (``get_xfer_descs`` + ``initialize_xfer``);
- ``memcpy``: one thread copying the same number of bytes (numpy).

Also printed: the delay from the sender's DONE to the receiver seeing the notification, and
the CPU the idle sender process burns. The receiver reads notifications as often as the
decode executor does (``--receiver-poll-s``). To show what each costs or gains:
``--error-handling peer`` (NIXL's default: the notification over TCP), ``--progress-thread``
(NIXL's own, spinning, in both processes), ``--huge-pages`` (both pools on transparent huge
pages). Run it under ``flock /tmp/meshserve-bench.lock``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np
import torch

from common.kv_layout import KVLayout, paired_extents
from gpu.host_memory import huge_page_zeros
from services.executor.decode_side import POLL_S
from services.executor.kv_transport import CPU_ERROR_HANDLING

LAYERS, PAGE_BYTES = 30, 24 * 1024  # SmolLM2-135M fp32: 3 KV heads x 64 x 16 tokens x K,V
KINDS = ("raw", "quiet", "ours", "ours_scattered", "unprepared", "memcpy")


def buffer(nbytes: int, huge: bool) -> np.ndarray:
    if not huge:
        return np.ones(nbytes, dtype=np.uint8)
    array = huge_page_zeros((nbytes,), torch.uint8).numpy()  # the KV pool's own allocation
    array[:] = 1
    return array


def pool(num_pages: int, huge: bool) -> tuple[list[np.ndarray], KVLayout]:
    layers = [buffer(num_pages * PAGE_BYTES, huge) for _ in range(LAYERS)]
    return layers, KVLayout(tuple(b.ctypes.data for b in layers), PAGE_BYTES, num_pages)


def transport(name: str, layout: KVLayout, opts: argparse.Namespace) -> Any:
    from services.executor.kv_transport import KVTransport

    return KVTransport(name, layout, opts.progress_thread, opts.error_handling)


def receiver(opts: argparse.Namespace, num_pages: int, to_parent: Any, from_parent: Any) -> None:
    _layers, layout = pool(num_pages, opts.huge_pages)
    rx = transport("probe-rx", layout, opts)
    to_parent.put((rx.metadata, layout))
    seen: list[tuple[bytes, float]] = []
    while True:  # as the decode side's pump does while a reservation waits
        for note in rx.notifications():
            seen.append((note, time.monotonic()))
            if note == b"stop":
                to_parent.put(seen)
                from_parent.get()
                return
        time.sleep(opts.receiver_poll_s)


def timed(fn: Any, repeat: int) -> list[float]:
    fn()  # warm-up: the first transfer to a peer connects and prepares its list
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def finish(agent: Any, handle: Any) -> None:
    state = agent.transfer(handle)
    while state == "PROC":
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(state)


def run_pair(opts: argparse.Namespace) -> dict[str, Any]:
    from services.executor.kv_transport import MEMORY

    sizes_mb, repeat = [float(s) for s in opts.sizes_mb.split(",")], opts.repeat
    pages_max = max(int(mb * 1e6 / (LAYERS * PAGE_BYTES)) + 1 for mb in sizes_mb)
    num_pages = 2 * pages_max + 2  # room for every other page
    ctx = mp.get_context("spawn")
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    args = (opts, num_pages, to_parent, from_parent)
    proc = ctx.Process(target=receiver, args=args, daemon=True)
    proc.start()
    metadata, dst = to_parent.get(timeout=30)
    _src_bufs, src = pool(num_pages, opts.huge_pages)
    tx = transport("probe-tx", src, opts)
    peer = tx.add_peer(metadata)
    agent = tx.agent
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(1.0)
    idle = (time.process_time() - cpu) / (time.perf_counter() - wall)
    results: dict[str, Any] = {"ucx_tls": os.environ.get("UCX_TLS", ""), "idle_cpu": idle,
                               "thread": opts.progress_thread, "huge": opts.huge_pages,
                               "poll": opts.receiver_poll_s, "eh": opts.error_handling,
                               "sizes": []}  # fmt: skip
    posted: list[tuple[bytes, float]] = []
    for mb in sizes_mb:
        pages = int(mb * 1e6 / (LAYERS * PAGE_BYTES)) or 1
        nbytes = pages * PAGE_BYTES * LAYERS
        row: dict[str, Any] = {"mb": nbytes / 1e6, "pages": pages}
        run = pages * PAGE_BYTES
        local = agent.prep_xfer_dlist("", [(b, run, 0) for b in src.layer_bases], MEMORY)
        remote = agent.prep_xfer_dlist(peer, [(b, run, 0) for b in dst.layer_bases], MEMORY)
        tag = f"raw-{mb}".encode()
        every = list(range(LAYERS))
        handle = agent.make_prepped_xfer("WRITE", local, every, remote, every, tag)

        def raw(handle: Any = handle, tag: bytes = tag) -> None:
            finish(agent, handle)
            posted.append((tag, time.monotonic()))

        row["raw"] = timed(raw, repeat)
        agent.release_xfer_handle(handle)
        handle = agent.make_prepped_xfer("WRITE", local, every, remote, every, b"")

        def quiet(handle: Any = handle) -> None:
            finish(agent, handle)

        row["quiet"] = timed(quiet, repeat)
        agent.release_xfer_handle(handle)
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
        for name, step in (("ours", 1), ("ours_scattered", 2)):
            chosen = list(range(0, pages * step, step))
            note = f"{name}-{mb}".encode()

            def ours(chosen: list[int] = chosen, note: bytes = note) -> None:
                tx.write(peer, chosen, dst, chosen, note, 60.0)
                posted.append((note, time.monotonic()))

            row[name] = timed(ours, repeat)
        note = f"unprepared-{mb}".encode()

        def unprepared(pages: int = pages, note: bytes = note) -> None:
            chosen = list(range(pages))
            s, d = paired_extents(src, chosen, dst, chosen)
            ls = agent.get_xfer_descs([(a, n, 0) for a, n in s], MEMORY)
            rs = agent.get_xfer_descs([(a, n, 0) for a, n in d], MEMORY)
            h = agent.initialize_xfer("WRITE", ls, rs, peer, note)
            finish(agent, h)
            agent.release_xfer_handle(h)
            posted.append((note, time.monotonic()))

        row["unprepared"] = timed(unprepared, repeat)
        a, b = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
        row["memcpy"] = timed(lambda a=a, b=b: np.copyto(b, a), repeat)
        results["sizes"].append(row)
    agent.send_notif(peer, b"stop")
    seen = to_parent.get(timeout=120)
    from_parent.put("bye")
    proc.join(10)
    # Notification delay: the k-th delivery of a tag against its k-th DONE.
    arrivals: dict[bytes, list[float]] = {}
    for note, at in seen:
        arrivals.setdefault(note, []).append(at)
    counts: dict[bytes, int] = {}
    delays: list[float] = []
    for note, at in posted:
        k = counts.get(note, 0)
        counts[note] = k + 1
        if k < len(arrivals.get(note, [])):
            delays.append(arrivals[note][k] - at)
    results["notify_delay_s"] = statistics.median(delays) if delays else None
    results["notified"] = f"{len(delays)}/{len(posted)}"
    return results


def summary(results: dict[str, Any]) -> list[str]:
    rows = [
        f"UCX_TLS={results['ucx_tls']}, error handling {results['eh']}, progress thread "
        f"{'on' if results['thread'] else 'off'}, "
        f"receiver polls every {results['poll'] * 1e3:.2f} ms, huge pages "
        f"{'on' if results['huge'] else 'off'}: idle sender {results['idle_cpu'] * 100:.0f}% "
        "of a core"
    ]
    for row in results["sizes"]:
        nbytes = row["mb"] * 1e6
        cells = []
        for key in KINDS:
            best, median = min(row[key]), statistics.median(row[key])
            cells.append(f"{key} {nbytes / best / 1e9:.1f}/{nbytes / median / 1e9:.1f}")
        rows.append(f"  {row['mb']:5.1f} MB  GB/s best/median: " + "  ".join(cells))
    delay = results["notify_delay_s"]
    rows.append(
        f"  notifications {results['notified']}, median "
        f"{'-' if delay is None else f'{delay * 1e3:.2f} ms'} after DONE"
    )
    return rows


def child_args(argv: list[str]) -> list[str]:
    """The command line less ``--tls`` (each child gets one value through UCX_TLS)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--tls":
            skip = True
        elif not arg.startswith("--tls="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.bench.kv_probe", description=__doc__)
    p.add_argument("--sizes-mb", default="1.5,7,53")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tls", default="all;tcp,cma", help="UCX_TLS values, ; between")
    p.add_argument("--progress-thread", action="store_true", help="NIXL's own, both sides")
    p.add_argument(
        "--receiver-poll-s",
        type=float,
        default=POLL_S,
        help="how often the receiver reads notifications (the decode side's)",
    )
    p.add_argument("--error-handling", default=CPU_ERROR_HANDLING, choices=["none", "peer"],
                   help="UCX's, in both agents (default: the transport's)")  # fmt: skip
    p.add_argument("--huge-pages", action="store_true", help="pools on transparent huge pages")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child's run
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_pair(args)), flush=True)
        return
    for tls in args.tls.split(";"):
        cmd = [sys.executable, "-m", "tools.bench.kv_probe", "--one", *child_args(argv or [])]
        env = {**os.environ, "UCX_TLS": tls}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode != 0 or not lines:
            print(f"UCX_TLS={tls}: failed ({done.returncode}): {done.stderr[-600:]}", flush=True)
            continue
        print("\n".join(summary(json.loads(lines[-1]))), flush=True)


if __name__ == "__main__":
    main()
