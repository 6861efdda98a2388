"""The checked-in generated protobuf code matches proto/ (regenerated with the pinned grpcio-tools)."""

import pathlib

import pytest

from duospec import protogen


def test_generated_code_matches_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    generated = protogen.generate(tmp_path)
    assert generated, "no .proto files found under proto/"
    stale = []
    for fresh in generated:
        rel = fresh.relative_to(tmp_path)
        checked_in = protogen.REPO_ROOT / rel
        if not checked_in.exists() or checked_in.read_text() != fresh.read_text():
            stale.append(str(rel))
    assert not stale, f"generated code is stale, run `make proto`: {stale}"


def test_every_proto_has_generated_modules():
    for proto in protogen.proto_files():
        rel = proto.relative_to(protogen.PROTO_ROOT).with_suffix("")
        module = protogen.REPO_ROOT / rel.parent / f"{rel.name}_pb2.py"
        assert module.exists(), f"{proto} has no generated module {module}; run `make proto`"


def test_public_service_importable():
    from duospec.v1 import generation_pb2, generation_pb2_grpc

    assert generation_pb2.DESCRIPTOR.package == "duospec.v1"
    assert hasattr(generation_pb2_grpc, "GenerationServiceServicer")
