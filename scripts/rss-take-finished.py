"""RSS of one engine over N short requests, with and without Engine.take_finished.

    python scripts/rss-take-finished.py [requests] [take|keep]

Submits `requests` requests (8-token prompts, 4 new tokens) in waves of 200 on a CPU engine (tiny seeded
float64 model, one torch thread), runs each wave to completion, and with `take` hands the finished results over
after each wave. Prints VmRSS (from /proc/self/status) after every 2,000 requests.
"""

import random
import sys

import torch

from executor import Engine, EngineConfig
from kvstate import SchedulerConfig


def rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    requests = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    take = (sys.argv[2] if len(sys.argv) > 2 else "take") == "take"
    torch.set_num_threads(1)
    rng = random.Random(0)
    taken = 0
    scheduler = SchedulerConfig(gpu_blocks=256, block_size=16, max_batch_size=64)
    with Engine(EngineConfig(scheduler=scheduler, device="cpu")) as engine:
        print(f"mode={'take_finished' if take else 'keep'} requests=0 rss_mib={rss_mib():.1f}", flush=True)
        for wave in range(0, requests, 200):
            for _ in range(200):
                engine.add_request([rng.randrange(512) for _ in range(8)], 4)
            engine.run()
            if take:
                taken += len(engine.take_finished())
            done = wave + 200
            if done % 2000 == 0:
                print(
                    f"mode={'take_finished' if take else 'keep'} requests={done} rss_mib={rss_mib():.1f} "
                    f"finished_held={len(engine.scheduler.finished)} submissions_held={len(engine._submissions)}",
                    flush=True,
                )
        assert not take or taken == requests


if __name__ == "__main__":
    main()
