"""Where a verify round's overhead goes through the server path: timestamps on both sides of the target's
gRPC stream, mode `off`, one request at a time (the overhead table's setting).

    git apply docs/bench-session16/scripts/target-trace.patch     (the target writes its side; revert after)
    REPLAY=<a `duospec bench --simulate` run>/replay-devices python docs/bench-session16/scripts/trace.py

Prints medians: the coordinator's send -> its stream's request generator handing the batch to gRPC ->
the target's servicer receiving it; the target's time outside Verifier.run; the target's reply -> the
coordinator's verdict handler; and the handler's own time until the next batch goes out. Wall clocks of
one machine (time.time()), so both processes must run here.
"""
import asyncio, os, pickle, statistics, time
os.environ["DUOSPEC_TRACE_TARGET"] = TRACE = "/tmp/duospec-target-trace.txt"
import torch
torch.set_num_threads(1)
from duospec.bench.inprocess import BenchPair, encode_prompts
from duospec.bench.prompts import load_prompts, DEFAULT_PROMPTS
from duospec.bench.served import served_pipeline, run_client_mode
from duospec.coordinator import links
from duospec.coordinator.config import SpeculationDefaults
from duospec.coordinator.scheduler import Scheduler
from duospec.engine import load_tokenizer

root = os.environ.get("REPLAY") or os.environ.get("MODELS", "models")
pair = BenchPair(f"{root}/target", f"{root}/draft", "cpu")
prompts = encode_prompts(load_tokenizer(pair.target), load_prompts(DEFAULT_PROMPTS, 6), 512)
SENT, HANDED, RECEIVED, DONE = {}, {}, {}, {}

on_verdict = Scheduler._on_verdict_batch


def traced_verdict(self, batch):
    RECEIVED[batch.batch_id] = time.time()
    on_verdict(self, batch)
    DONE[batch.batch_id] = time.time()


Scheduler._on_verdict_batch = traced_verdict


async def traced_requests(self):
    while True:
        message = await self.outbox.get()
        if message is links._END:
            return
        if hasattr(message, "items"):  # a VerifyBatch
            HANDED[message.batch_id] = time.time()
        yield message


links.GrpcStreamLink._requests = traced_requests
init = Scheduler.__init__


class _TimedLink:
    def __init__(self, link):
        self.link = link

    def send(self, message):
        SENT[message.batch_id] = time.time()
        self.link.send(message)

    def __getattr__(self, name):
        return getattr(self.link, name)


def traced_init(self, *a, **k):
    init(self, *a, **k)
    self.target = _TimedLink(self.target)


Scheduler.__init__ = traced_init


async def main():
    if os.path.exists(TRACE):
        os.remove(TRACE)
    async with served_pipeline(pair, SpeculationDefaults(), None) as served:
        await run_client_mode(served, prompts, "off", 128, lambda: None, variant="off")
        for d in (SENT, HANDED, RECEIVED, DONE):
            d.clear()
        run = await run_client_mode(served, prompts, "off", 128, lambda: None, variant="off")
    print(f"off through the server: {run.tokens_per_s:.1f} tokens/s")
    out, handed, inside, back, handling = [], [], [], [], []
    for line in open(TRACE):
        batch_id, arrived, replied, forward = line.split()
        b, arrived, replied, forward = int(batch_id), float(arrived), float(replied), float(forward)
        if b in SENT and b in HANDED and b in RECEIVED:
            handed.append(HANDED[b] - SENT[b])
            out.append(arrived - HANDED[b])
            inside.append(replied - arrived - forward)
            back.append(RECEIVED[b] - replied)
            if b in DONE:
                handling.append(DONE[b] - RECEIVED[b])
    ms = lambda xs: f"{statistics.median(xs) * 1e3:.3f}"
    print(f"{len(out)} rounds, medians (ms): send -> handed to gRPC {ms(handed)}, -> target receives {ms(out)}, "
          f"target outside Verifier.run {ms(inside)}, target replies -> coordinator's handler {ms(back)}, "
          f"handler until the next batch is sent {ms(handling)}")

asyncio.run(main())
