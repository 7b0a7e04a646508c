"""The scalars of TensorBoard event files, read with tensorboardX's protobufs (local or gs://)."""

from __future__ import annotations

import struct

from etils import epath


def tensorboard_scalars(directory: str) -> set[tuple[str, int]]:
    """(tag, step) of every scalar in the TFRecord event files under ``directory``."""
    from tensorboardX.proto import event_pb2

    found = set()
    for file in epath.Path(directory).iterdir():
        raw, pos = file.read_bytes(), 0
        while pos < len(raw):
            (length,) = struct.unpack("<Q", raw[pos : pos + 8])
            event = event_pb2.Event.FromString(raw[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, the record, its crc
            found |= {(v.tag, event.step) for v in event.summary.value}
    return found
