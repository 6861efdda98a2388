"""SamplingParams on the internal wire (pearl.proto `Sampling`), shared by the coordinator and both
workers so all three read the same values."""

from __future__ import annotations

from duospec.internal.v1 import pearl_pb2 as pb
from duospec.sampling import SamplingParams


def sampling_from_proto(msg: pb.Sampling) -> SamplingParams:
    return SamplingParams(
        temperature=float(msg.temperature), top_k=int(msg.top_k), top_p=float(msg.top_p) or 1.0, seed=int(msg.seed)
    )


def sampling_to_proto(params: SamplingParams) -> pb.Sampling:
    return pb.Sampling(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed)
