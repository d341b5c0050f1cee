"""Score and ScoreBatch requests parsed one sample at a time when the whole message does not parse.

protobuf refuses a message nested past its recursion limit, and a sample's ``extra_info`` (a Struct) can nest
as deep as its sender likes: parsed whole, one such sample would fail every other sample of its message (a
stream, or a ScoreBatch call). The generated deserializer runs first; only when it fails is the message
split at the wire level into its samples, each parsed on its own. A sample that still does not parse is
answered INVALID_ARGUMENT under its own id; every other one is scored as usual.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from rewardmesh.common.errors import InvalidInput
from rewardmesh.common.protowire import LEN, fields
from rewardmesh.v1 import common_pb2, reward_pb2

# The message, or (the message, its refusals) when a sample did not parse.
Refusals = dict[int, InvalidInput]  # index of the sample that did not parse: its error; -1: ScoreRequest.sample
ParsedScore = reward_pb2.ScoreRequest | tuple[reward_pb2.ScoreRequest, Refusals]
ParsedBatch = reward_pb2.ScoreBatchRequest | tuple[reward_pb2.ScoreBatchRequest, Refusals]

_SCORE_SAMPLE, _SCORE_ITEMS = 1, 5  # ScoreRequest.sample, ScoreRequest.items
_BATCH_SAMPLES = 2  # ScoreBatchRequest.samples
_MAX_ID_CHARS = 512


def _sample_id(sample: bytes) -> str:
    """The sample_id (field 1) of a Sample that does not parse as a whole; "" when it has none."""
    try:
        for f in fields(sample):
            if f.number == 1 and f.wire == LEN:
                return sample[f.start : min(f.end, f.start + _MAX_ID_CHARS)].decode("utf-8", "replace")
    except DecodeError:
        pass
    return ""


def _refusal(sample: bytes, where: str) -> tuple[common_pb2.Sample, InvalidInput]:
    stub = common_pb2.Sample(sample_id=_sample_id(sample))
    return stub, InvalidInput(
        f"{where} does not parse: sample.extra_info nested too deeply (the limit is max_extra_info_depth) "
        "or the bytes are not a valid Sample"
    )


def parse_score_request(data: bytes) -> ParsedScore:
    try:
        return reward_pb2.ScoreRequest.FromString(data)
    except DecodeError:
        pass
    rest = bytearray()
    refusals: Refusals = {}
    items: list[reward_pb2.ScoreRequest] = []
    single: common_pb2.Sample | None = None
    for f in fields(data):  # a DecodeError here: the message itself is broken
        if f.number == _SCORE_ITEMS and f.wire == LEN:
            payload = data[f.start : f.end]
            try:
                items.append(reward_pb2.ScoreRequest.FromString(payload))
            except DecodeError:
                strings = _strings(payload)
                stub, error = _refusal(strings.get(_SCORE_SAMPLE, b""), f"items[{len(items)}].sample")
                refusals[len(items)] = error
                reward = strings.get(2, b"").decode("utf-8", "replace")
                items.append(reward_pb2.ScoreRequest(sample=stub, reward=reward))
        elif f.number == _SCORE_SAMPLE and f.wire == LEN:
            single, refusals[-1] = _refusal(data[f.start : f.end], "sample")
        else:
            rest += data[f.begin : f.end]
    request = reward_pb2.ScoreRequest.FromString(bytes(rest))
    request.items.extend(items)
    if single is not None:
        request.sample.CopyFrom(single)
    return request, refusals


def parse_score_batch_request(data: bytes) -> ParsedBatch:
    try:
        return reward_pb2.ScoreBatchRequest.FromString(data)
    except DecodeError:
        pass
    rest = bytearray()
    refusals: Refusals = {}
    samples: list[common_pb2.Sample] = []
    for f in fields(data):
        if f.number == _BATCH_SAMPLES and f.wire == LEN:
            payload = data[f.start : f.end]
            try:
                samples.append(common_pb2.Sample.FromString(payload))
            except DecodeError:
                stub, refusals[len(samples)] = _refusal(payload, f"samples[{len(samples)}]")
                samples.append(stub)
        else:
            rest += data[f.begin : f.end]
    request = reward_pb2.ScoreBatchRequest.FromString(bytes(rest))
    request.samples.extend(samples)
    return request, refusals


def _strings(message: bytes) -> dict[int, bytes]:
    """The length-delimited top-level fields of a message that does not parse (the last of each number)."""
    try:
        return {f.number: message[f.start : f.end] for f in fields(message) if f.wire == LEN}
    except DecodeError:
        return {}
