"""Regenerates the checked-in protobuf/gRPC modules from proto/.

Generated code is checked in so that a fresh clone (and an installed wheel) works without
grpcio-tools; tests/unit/test_proto_drift.py regenerates into a temporary directory and fails on drift.
The generator version is pinned in pyproject's dev extra so the output is reproducible.

    python -m duospec.protogen            # rewrite duospec/**/_pb2*.py from proto/
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"


def proto_files(proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    return sorted(proto_root.rglob("*.proto"))


def generate(out_dir: pathlib.Path, proto_root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Runs protoc on every .proto under proto_root; returns the generated files under out_dir."""
    from grpc_tools import protoc  # dev-only dependency

    out_dir.mkdir(parents=True, exist_ok=True)
    files = [str(p.relative_to(proto_root)) for p in proto_files(proto_root)]
    args = [
        "protoc",
        f"-I{proto_root}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed for {files}")
    generated = []
    for proto in files:
        stem = out_dir / pathlib.Path(proto).with_suffix("")
        generated += [stem.with_name(stem.name + suffix) for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]
    for package_dir in {p.parent for p in generated}:
        init = package_dir / "__init__.py"
        if not init.exists():
            init.touch()
    return generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=REPO_ROOT, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
