#!/usr/bin/env python3
"""Writes the hand-made safetensors seeds in fuzz/corpus/safetensors/ (each well under 20 KB).

Mostly valid files covering every dtype, scalars, empty tensors, metadata, unpadded headers and
misaligned tensors, plus a few near-misses so the fuzzer starts next to each validation branch.
Re-run after changing it: python3 fuzz/make_seeds.py
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus", "safetensors")
SIZES = {"F32": 4, "F64": 8, "BF16": 2, "F16": 2, "I32": 4, "I64": 8}
PACK = {"F32": "<f", "F64": "<d", "I32": "<i", "I64": "<q"}


def values(dtype, n, seed):
    vals = [((i * 37 + seed * 11) % 23 - 11) / 4 for i in range(n)]
    if dtype in PACK:
        fmt = PACK[dtype]
        return b"".join(struct.pack(fmt, int(v) if dtype.startswith("I") else v) for v in vals)
    out = b""
    for v in vals:
        f32 = struct.unpack("<I", struct.pack("<f", v))[0]
        if dtype == "BF16":
            out += struct.pack("<H", f32 >> 16)
        else:
            out += struct.pack("<e", v)
    return out


def build(tensors, metadata=None, pad=True, header_override=None, extra=b""):
    """tensors: list of (name, dtype, shape, bytes or None)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        n = 1
        for d in shape:
            n *= d
        raw = values(dtype, n, len(data)) if raw is None else raw
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = header_override if header_override is not None else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - (8 + len(h)) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data + extra


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {
        "every_dtype": build([(f"t_{d}", d, [2, 3], None) for d in SIZES]),
        "scalars_and_vectors": build([("s", "F32", [], None), ("v", "I64", [5], None), ("h", "F16", [1], None)]),
        "empty_tensors": build([("e0", "F32", [0], None), ("w", "BF16", [4], None), ("e1", "I32", [3, 0], None)]),
        "metadata": build([("w", "F32", [2, 2], None)], metadata={"format": "pt", "step": "12"}),
        "metadata_only": build([], metadata={"k": "v"}),
        "nothing": build([]),
        "unpadded_odd_header": build([("x", "F32", [3], None), ("y", "F64", [2], None)], pad=False),
        "misaligned": build([("a", "BF16", [3], None), ("b", "F32", [5], None), ("c", "F64", [2], None)]),
        "special_floats": build([("f", "F32", [4], struct.pack("<4f", float("nan"), float("inf"), -0.0, 1e-45)),
                                 ("h", "F16", [3], struct.pack("<3H", 0x7C00, 0x0001, 0xFC01)),
                                 ("i", "I64", [2], struct.pack("<2q", -(2**63), 2**63 - 1))]),
        "rank4": build([("k", "F32", [2, 1, 3, 2], None)]),
        # Near misses: one field away from valid.
        "bad_truncated": build([("w", "F32", [8], None)])[:-5],
        "bad_overlap": build([], header_override=json.dumps({
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}).encode(), extra=bytes(16)),
        "bad_dtype": build([("w", "U8", [4], bytes(4))]),
        "bad_byte_count": build([], header_override=b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}',
                                extra=bytes(16)),
        "bad_metadata": build([], header_override=b'{"__metadata__":{"n":1}}'),
    }
    for name, blob in seeds.items():
        assert len(blob) < 20 * 1024, name
        with open(os.path.join(OUT, name + ".safetensors"), "wb") as f:
            f.write(blob)
    print(f"wrote {len(seeds)} seeds to {OUT}")


if __name__ == "__main__":
    main()
