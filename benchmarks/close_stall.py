"""How long the event loop stalls while a session closes with an async write in flight.

A heartbeat task sleeps 5 ms at a time beside a session whose body fails right
after a 400 MB asynchronous checkpoint write started; the session then closes
with the write still going. The longest heartbeat gap during the close is the
loop's longest stall; it is printed next to how long the close took (a loop that
joined the writer thread would stall for about all of it).

    python benchmarks/close_stall.py [--megabytes 400]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from _results import write

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


async def measure(megabytes: int) -> tuple[float, float]:
    import anyio
    import tensorflow as tf

    import asupervisor as asv

    state = tf.Module()
    per = megabytes * 1024 * 1024 // 4 // 4
    state.w = [tf.Variable(tf.random.normal((per,))) for _ in range(4)]
    sv = asv.Supervisor(
        tempfile.mkdtemp(),
        checkpoint={"state": state},
        async_checkpoint=True,
        save_model_secs=0,
        save_model_steps=10**9,
        save_summaries_secs=0,
        handle_signals=False,
    )
    gaps: list[tuple[float, float]] = []
    window: list[float] = []
    done = anyio.Event()

    async def heartbeat() -> None:
        while not done.is_set():
            began = time.perf_counter()
            await anyio.sleep(0.005)
            gaps.append((began, time.perf_counter() - began))

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        try:
            async with sv.session() as sess:
                await sess.call(lambda: state.w[0].assign_add(tf.ones_like(state.w[0])))
                await sess.save_checkpoint()  # the background write starts
                window.append(time.perf_counter())
                raise RuntimeError("the body fails with the write in flight")
        except RuntimeError:
            window.append(time.perf_counter())
        done.set()
    start, end = window
    return max(g for b, g in gaps if start <= b <= end), end - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megabytes", type=int, default=400, help="state size (default: 400)")
    args = parser.parse_args()
    import anyio

    stall, close = anyio.run(measure, args.megabytes)
    print(f"state {args.megabytes} MB, async write in flight at close")
    print(f"close took            {close * 1000:8.1f} ms")
    print(f"longest loop stall    {stall * 1000:8.1f} ms  ({stall / close:.1%} of the close)")
    row = {"state MB": args.megabytes, "close s": close, "longest loop stall s": stall}
    write("close_stall", [row])


if __name__ == "__main__":
    main()
