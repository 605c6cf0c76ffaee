#!/usr/bin/env python3
"""Writes the safetensors test corpus under tests/fixtures/safetensors/.

bad/*.safetensors each carry exactly one defect; bad_expected.tsv maps every
file to a phrase the reader's error message must contain, so a test can tell
"rejected for the right reason" from "rejected by accident". good/ holds
small valid files with known contents. tests/fuzz/corpus/framed_* are the
same files in the fuzz target's "header, newline, data" form. The outputs
are committed; rerun this script (stdlib only, deterministic) after
changing it:

    python3 tests/io/make_bad_corpus.py
"""

import json
import os
import struct
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "safetensors")


def header_bytes(header, pad=True):
    """The header as written by hand: `header` is a dict or already-built text."""
    text = header if isinstance(header, (str, bytes)) else json.dumps(header, separators=(",", ":"))
    raw = text if isinstance(text, bytes) else text.encode("utf-8")
    if pad:
        raw += b" " * ((8 - len(raw) % 8) % 8)
    return raw


def file_bytes(header, data=b"", pad=True, length=None):
    raw = header_bytes(header, pad)
    n = len(raw) if length is None else length
    return struct.pack("<Q", n) + raw + data


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def tensor(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


W16 = f32([1.0, 2.0, 3.0, 4.0])  # 16 bytes: one F32 [4] or [2,2] tensor


def bad_cases():
    """(file stem, bytes, phrase the error must contain)."""
    yield "too_short", b"\x10\x00\x00\x00\x00", "shorter than the 8-byte header length"
    yield "header_length_zero", struct.pack("<Q", 0) + b"{}" + b" " * 6, "header length is 0"
    yield ("header_length_huge", file_bytes({}, length=200_000_000),
           "exceeds the limit of 100000000 bytes")
    yield ("header_length_past_eof", file_bytes({"w": tensor("F32", [4], 0, 16)}, W16, length=4096),
           "runs past the end of the file")
    yield "not_json", file_bytes("{\"w\": {\"dtype\": F32}"), "header is not valid JSON"
    yield "not_an_object", file_bytes("[1, 2, 3]"), "instead of '{'"
    yield "leading_whitespace", file_bytes(" {}", pad=False), "instead of '{'"
    yield "nul_padding", struct.pack("<Q", 8) + b"{}\x00\x00\x00\x00\x00\x00", "header is not valid JSON"
    yield ("invalid_utf8", file_bytes(b'{"w\xff\xfe":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}', W16),
           "header is not valid JSON")
    yield "entry_not_object", file_bytes({"w": [0, 16]}, W16), "expected an object with fields"
    yield ("missing_field", file_bytes({"w": {"dtype": "F32", "shape": [4]}}, W16),
           "lacks field 'data_offsets'")
    yield ("extra_field", file_bytes({"w": dict(tensor("F32", [4], 0, 16), strides=[1])}, W16),
           "unexpected field 'strides'")
    yield "unknown_dtype", file_bytes({"w": tensor("F8_E4M3", [16], 0, 16)}, W16), "unknown dtype \"F8_E4M3\""
    yield "dtype_lowercase", file_bytes({"w": tensor("f32", [4], 0, 16)}, W16), "unknown dtype \"f32\""
    yield ("dtype_not_string", file_bytes({"w": {"dtype": 4, "shape": [4], "data_offsets": [0, 16]}}, W16),
           "expected a string, one of")
    yield "shape_not_array", file_bytes({"w": tensor("F32", 4, 0, 16)}, W16), "expected an array of non-negative integers"
    yield "shape_negative", file_bytes({"w": tensor("F32", [-2, -2], 0, 16)}, W16), "is not a non-negative 64-bit integer"
    yield ("shape_float", file_bytes('{"w":{"dtype":"F32","shape":[2.0,2],"data_offsets":[0,16]}}', W16),
           "is not a non-negative 64-bit integer")
    yield ("shape_beyond_int64", file_bytes({"w": tensor("U8", [2**64 - 1], 0, 16)}, W16),
           "is not a non-negative 64-bit integer")
    yield ("shape_overflow", file_bytes({"w": tensor("F32", [2**62, 2**62], 0, 16)}, W16),
           "overflows 64 bits")
    yield ("offsets_one_number", file_bytes({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16]}}, W16),
           "expected an array of two non-negative integers")
    yield "offsets_negative", file_bytes({"w": tensor("F32", [0], -4, -4)}, W16), "expected an array of two non-negative integers"
    yield "offsets_reversed", file_bytes({"w": tensor("F32", [0], 16, 0)}, W16), "whose begin exceeds its end"
    yield "offsets_past_end", file_bytes({"w": tensor("F32", [16], 0, 64)}, W16), "run past the end of the data section"
    yield "size_mismatch", file_bytes({"w": tensor("F32", [2, 3], 0, 16)}, W16), "needs 24 bytes"
    yield ("overlap", file_bytes({"a": tensor("F32", [4], 0, 16), "b": tensor("F32", [2], 8, 16)}, W16),
           "overlaps tensor 'a'")
    yield ("hole", file_bytes({"a": tensor("F32", [1], 0, 4), "b": tensor("F32", [2], 8, 16)}, W16),
           "data bytes [4, 8) belong to no tensor")
    yield "trailing_bytes", file_bytes({"w": tensor("F32", [2], 0, 8)}, W16), "the last 8 of the 16 data bytes"
    yield "data_without_tensors", file_bytes({}, W16), "the last 16 of the 16 data bytes"
    yield ("duplicate_name",
           file_bytes('{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                      '"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}', W16),
           "names 'w' more than once")
    yield ("duplicate_field",
           file_bytes('{"w":{"dtype":"F32","dtype":"I32","shape":[4],"data_offsets":[0,16]}}', W16),
           "has field 'dtype' more than once")
    yield ("metadata_not_object", file_bytes({"__metadata__": "pt", "w": tensor("F32", [4], 0, 16)}, W16),
           "__metadata__ is a JSON string")
    yield ("metadata_value_not_string",
           file_bytes({"__metadata__": {"epoch": 3}, "w": tensor("F32", [4], 0, 16)}, W16),
           "__metadata__ entry 'epoch' is a JSON number")


def good_cases():
    mixed_data = b""
    mixed = {"__metadata__": {"format": "pt", "source": "tests/io/make_bad_corpus.py"}}

    def add(name, dtype, shape, payload):
        nonlocal mixed_data
        mixed[name] = tensor(dtype, shape, len(mixed_data), len(mixed_data) + len(payload))
        mixed_data += payload

    add("scalar_f64", "F64", [], struct.pack("<d", -2.5))
    add("weight_f32", "F32", [2, 3], f32([0.5 * i - 1.0 for i in range(6)]))
    add("bias_bf16", "BF16", [4], struct.pack("<4H", 0x3F80, 0xC000, 0x3E00, 0x0000))  # 1, -2, 0.125, 0
    add("half_f16", "F16", [3], struct.pack("<3H", 0x3C00, 0xB800, 0x7BFF))  # 1, -0.5, 65504
    add("steps_i64", "I64", [2], struct.pack("<2q", -7, 1 << 40))
    add("mask_bool", "BOOL", [3], bytes([1, 0, 1]))
    add("empty_u8", "U8", [0, 3], b"")
    yield "mixed_dtypes", file_bytes(mixed, mixed_data)
    yield "empty", file_bytes({})
    # No padding: the F32 data starts at an odd file offset, so readers must
    # not assume aligned data.
    yield "unaligned", file_bytes('{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,12]}}',
                                  f32([1.5, -3.0, 1e-3]), pad=False)


def framed_seeds():
    """Seeds for the fuzzer's second reading, "header text\\ndata" with the
    length prefix derived (see tests/fuzz/fuzz_safetensors.cpp)."""
    for stem, data in good_cases():
        n = struct.unpack("<Q", data[:8])[0]
        yield stem, data[8:8 + n] + b"\n" + data[8 + n:]
    for stem, data, _ in bad_cases():
        if len(data) >= 8:
            n = struct.unpack("<Q", data[:8])[0]
            if n < len(data):
                yield stem, data[8:8 + n] + b"\n" + data[8 + n:]


def write(path, data):
    with open(path, "wb") as out:
        out.write(data)


def main():
    bad_dir = os.path.join(ROOT, "bad")
    good_dir = os.path.join(ROOT, "good")
    os.makedirs(bad_dir, exist_ok=True)
    os.makedirs(good_dir, exist_ok=True)
    expected = []
    for stem, data, phrase in bad_cases():
        write(os.path.join(bad_dir, stem + ".safetensors"), data)
        expected.append("%s.safetensors\t%s" % (stem, phrase))
    with open(os.path.join(ROOT, "bad_expected.tsv"), "w") as out:
        out.write("# file<TAB>phrase the reader's error message must contain\n")
        out.write("\n".join(expected) + "\n")
    for stem, data in good_cases():
        write(os.path.join(good_dir, stem + ".safetensors"), data)
    seed_dir = os.path.join(ROOT, "..", "..", "fuzz", "corpus")
    os.makedirs(seed_dir, exist_ok=True)
    seeds = 0
    for stem, data in framed_seeds():
        write(os.path.join(seed_dir, "framed_" + stem), data)
        seeds += 1
    print("wrote %d bad and 3 good files under %s, %d framed fuzz seeds" %
          (len(expected), os.path.normpath(ROOT), seeds), file=sys.stderr)


if __name__ == "__main__":
    main()
