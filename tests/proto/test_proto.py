"""The generated gRPC stubs must match the contract in proto/ (regenerate with `make proto`)."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"
GENERATED = ("sprinter/v1/decoding_pb2.py", "sprinter/v1/decoding_pb2_grpc.py", "sprinter/v1/decoding_pb2.pyi")


def test_stubs_are_fresh(tmp_path):
    status = protoc.main(["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                          f"--grpc_python_out={tmp_path}", str(PROTO_ROOT / "sprinter/v1/decoding.proto")])
    assert status == 0
    for name in GENERATED:
        assert (PROTO_ROOT / name).read_text() == (tmp_path / name).read_text(), f"{name} is stale: run `make proto`"
