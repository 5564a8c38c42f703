"""The exchange's header on the wire: its words in their documented places, read back by name."""

import numpy as np

from paddle_unpad.distributed import wire


def test_a_header_is_its_fields_then_zeros_then_the_message():
    h = wire.Header(status=wire.ERROR, step=7, count=3, schema_hash=12345, plan_key=2**61 + 5, message="bad sample")
    words = h.encode()
    assert words.dtype == np.int64 and words.shape == (wire.HDR,) == (56,)
    assert words[:8].tolist() == [wire.ERROR, 7, 3, 12345, 2**61 + 5, 0, 0, 0]
    text = words[8:].tobytes()
    assert text == b"bad sample".ljust(8 * 48, b"\0")


def test_a_long_message_is_cut_to_its_slot():
    words = wire.Header(wire.OK, 0, 0, 0, 0, message="x" * 1000).encode()
    assert words.shape == (wire.HDR,) and words[wire.MSG_AT :].tobytes() == b"x" * wire.MSG_BYTES


def test_gathered_headers_are_read_by_field_name():
    sent = [
        wire.Header(wire.OK, 4, 2, 99, 11, message='[["input_ids","t","<i8",[]]]'),
        wire.Header(wire.END, 4, 0, 0, 11),
        wire.Header(wire.ABORT, 3, 0, 0, 12, message="its loop stopped"),
    ]
    H = wire.Headers.decode(np.stack([h.encode() for h in sent]))
    assert H._fields[:-1] == wire.HEADER_FIELDS  # one column per header field, in wire order
    for name in wire.HEADER_FIELDS:
        assert getattr(H, name).tolist() == [getattr(h, name) for h in sent], name
    assert [H.message(r) for r in range(3)] == [h.message for h in sent]
