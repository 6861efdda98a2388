"""A gateway killed under load (issue 45): `duospec serve --gateways 2`, 16 seeded sampled streams, one
gateway killed with SIGKILL while every stream is under way. Measured from the client's side of each
stream (chunk arrival times), on SIMULATED devices as benchmarks/scale_out.py runs them:

- the streams on the surviving gateway: their longest gap between chunks from the kill to the end,
  against their own median gap (one verify round, as pearl delivers a round's tokens at once) and
  their longest gap before the kill;
- the streams on the killed gateway: how long their resume took (the gap across the break), and
  whether each equals its unbroken run (every stream is also run once beforehand, unbroken).

    python benchmarks/gateway_kill.py                    # 2 replicas, 16 streams, 192 new tokens
    python benchmarks/gateway_kill.py --replicas 1 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import scale_out  # noqa: E402  (the simulated pair, the config and the readiness check are shared)

from duospec.coordinator.serving.gateways import RESTART_BACKOFF_S as RESTART_AFTER_S  # noqa: E402

STREAMS = 16
CHANNELS = 8  # client connections: SO_REUSEPORT spreads connections, not streams, over the gateways


def gateway_pids(parent: int) -> list[int]:
    """The supervisor's gateway children (process title `duospec-gateway <i>`)."""
    found = []
    for pid, cmdline in scale_out._processes().items():
        try:
            ppid = int(pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == parent and cmdline.startswith("duospec-gateway"):
            found.append(pid)
    return sorted(found)


async def _streams(address: str, prompts, max_new_tokens: int, kill_pid: int | None) -> tuple[list, set, float]:
    """Runs STREAMS seeded streams; with `kill_pid`, kills it once every stream has 16 tokens. Returns
    per stream (tokens, chunk arrival times), the indices of the streams that broke, the kill time."""
    import duospec
    from duospec.sdk import resume

    broke: set[int] = set()
    broken = resume.Generation.broken

    def recording(self, error):  # which streams had to resume (the benchmark's probe, not the SDK's API)
        broke.add(self.original.sampling.seed - 1000)
        return broken(self, error)

    resume.Generation.broken = recording
    clients = [duospec.AsyncClient(address, timeout=300, grpc_options=(("grpc.use_local_subchannel_pool", 1),))
               for _ in range(CHANNELS)]
    results: list = [None] * STREAMS
    counts = [0] * STREAMS

    async def stream(i: int) -> None:
        tokens, times = [], []
        prompt = prompts[i % len(prompts)]
        async for chunk in await clients[i % CHANNELS].generate(
                prompt_token_ids=list(prompt.token_ids), max_new_tokens=max_new_tokens, ignore_eos=True,
                temperature=0.8, seed=1000 + i, mode="pearl", stream=True):
            if chunk.token_ids:
                tokens += chunk.token_ids
                times.append(time.perf_counter())
                counts[i] = len(tokens)
        results[i] = (tokens, times)

    try:
        tasks = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
        killed_at = 0.0
        if kill_pid is not None:
            while min(counts) < 16:
                await asyncio.sleep(0.005)
            os.kill(kill_pid, signal.SIGKILL)
            killed_at = time.perf_counter()
        await asyncio.gather(*tasks)
    finally:
        resume.Generation.broken = broken
        for client in clients:
            await client.close()
    return results, broke, killed_at


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    args = parser.parse_args(argv)

    pair, prompts, speculation, _, folder = scale_out.simulated_pair("duospec-gateway-kill-", args.max_new_tokens)
    port = scale_out._free_port()
    config = scale_out._write_config(folder, pair, speculation, args.replicas, 2, port)
    server = subprocess.Popen([sys.executable, "-m", "duospec", "serve", "--config", str(config)],
                              env={**os.environ, "DUOSPEC_TORCH_THREADS": "1"}, stdout=subprocess.DEVNULL,
                              stderr=open(folder / "serve.log", "w"))
    address = f"127.0.0.1:{port}"
    try:
        asyncio.run(scale_out._wait_serving(port, 300))
        deadline = time.monotonic() + 60
        while len(gateway_pids(server.pid)) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("two gateways did not come up")
            time.sleep(0.5)
        unbroken, _, _ = asyncio.run(_streams(address, prompts, args.max_new_tokens, None))
        victim = gateway_pids(server.pid)[0]
        results, broke, killed_at = asyncio.run(_streams(address, prompts, args.max_new_tokens, victim))
    finally:
        scale_out.stop(server)

    print(f"SIMULATED devices, 2 gateways, {args.replicas} replicas, {STREAMS} seeded sampled pearl streams of "
          f"{args.max_new_tokens} tokens over {CHANNELS} connections; one gateway killed (SIGKILL) once every "
          f"stream had 16 tokens; logs in {folder}")
    equal = sum(r[0] == u[0] for r, u in zip(results, unbroken))
    print(f"streams whole and equal to their unbroken run: {equal}/{STREAMS}; resumed: {len(broke)}")
    print("| stream | gateway | median gap (ms) | longest gap before the kill (ms) | longest gap in the second "
          "after it (ms) | / median | longest gap after it (ms) | it ended (ms after the kill) |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    ratios = {"survived": [], "killed": []}
    for i, (_, times) in enumerate(results):
        gaps = [b - a for a, b in zip(times, times[1:])]
        before = [b - a for a, b in zip(times, times[1:]) if b < killed_at]
        after = [(b - a, b) for a, b in zip(times, times[1:]) if b >= killed_at]
        median = statistics.median(gaps)
        kind = "killed" if i in broke else "survived"
        longest, ended = max(after, default=(0.0, killed_at))
        # the first second: the kill itself, before the supervisor starts the gateway again (its start-up
        # takes a core for seconds, which on a 2-core machine slows every process)
        first = max((gap for gap, end in after if end - gap < killed_at + RESTART_AFTER_S), default=0.0)
        ratios[kind].append(first / median)
        print(f"| {i} | {kind} | {1e3 * median:.1f} | {1e3 * max(before, default=0.0):.1f} | {1e3 * first:.1f} | "
              f"{ratios[kind][-1]:.1f} | {1e3 * longest:.1f} | {1e3 * (ended - killed_at):.0f} |")
    for kind, values in ratios.items():
        if values:
            print(f"{kind}: longest gap in the second after the kill / own median gap: median "
                  f"{statistics.median(values):.1f}, max {max(values):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
