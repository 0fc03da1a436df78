"""Build a suffix-decoding-only wheel of arctic-inference 0.3.0, for vLLM's `method = "suffix"`.

    python3 bench/gpu/arctic_wheel.py OUT_DIR            # for the Python running this script
    python3 bench/gpu/arctic_wheel.py OUT_DIR --abi3     # cp312-abi3: any CPython >= 3.12, e.g. the GPU host's

arctic-inference 0.3.0 is on PyPI as a source archive only, and its setup.py wants torch and grpcio-tools at
build time (for CUDA ops and an embedding server that vLLM never uses) and registers a vLLM plugin. vLLM's
suffix proposer imports `arctic_inference.suffix_decoding.SuffixDecodingCache` and nothing else, so this
builds only that: the C++ suffix tree (csrc/suffix_decoding, nanobind) plus the two Python files over it,
with no plugin entry point, as version `0.3.0+suffix`. It needs g++ (C++20) and nothing from CUDA or torch, except
that pip reads the sdist's metadata by running its setup.py, which imports torch: that step runs on a Python with
torch (this one, or the project's .venv).

`--abi3` builds against Python's stable ABI for 3.12 (nanobind's STABLE_ABI mode: Py_LIMITED_API=0x030C0000),
so one build serves every CPython from 3.12 on without a 3.12 interpreter here. The stable-ABI headers come
from Debian's libpython3.13-dev (downloaded, never installed), since no Debian release packages 3.12.
Downloads are cached in BUNDLE_CACHE (default /tmp/batchjson-bundle)/arctic.
"""
import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

VERSION = "0.3.0"
NANOBIND = "2.9.2"  # the version the sdist's build-system pins
ABI3_DEB = "libpython3.13-dev"
ABI3_SUITE = "trixie"


def has_torch(python: str) -> bool:
    return subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(not importlib.util.find_spec('torch'))"],
                          capture_output=True).returncode == 0


def metadata_python() -> str:
    """A Python that can prepare the sdist's metadata: its setup.py imports torch. This one if it has torch, else the
    project's .venv (pip download only runs it there; nothing is installed), else none: say how to get one."""
    venv = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "python"
    for python in (sys.executable, str(venv)):
        if Path(python).exists() and has_torch(python):
            return python
    sys.exit(f"arctic_wheel.py: arctic-inference {VERSION}'s setup.py imports torch even to read its metadata, and "
             f"neither {sys.executable} nor {venv} has torch. Create the project's .venv (README.md), or run this "
             "script with a Python that has torch.")


def download(cache: Path) -> tuple[Path, Path]:
    """The sdist unpacked and nanobind unpacked, downloaded once into `cache`."""
    src, nb = cache / f"arctic_inference-{VERSION}", cache / f"nanobind-{NANOBIND}"
    pip = ["-m", "pip", "download", "-q", "--no-deps", "-d", str(cache)]
    if not src.is_dir():
        # --no-build-isolation: pip prepares the sdist's metadata, which would otherwise install torch.
        subprocess.run([metadata_python(), *pip, "--no-binary", ":all:", "--no-build-isolation",
                        f"arctic-inference=={VERSION}"], check=True)
        shutil.unpack_archive(cache / f"arctic_inference-{VERSION}.tar.gz", cache)
    if not nb.is_dir():
        subprocess.run([sys.executable, *pip, "--only-binary", ":all:", f"nanobind=={NANOBIND}"], check=True)
        zipfile.ZipFile(cache / f"nanobind-{NANOBIND}-py3-none-any.whl").extractall(nb)
    return src, nb / "nanobind"


def abi3_includes(cache: Path) -> list[str]:
    """Include dirs of Debian's CPython 3.13 headers (any headers >= 3.12 serve the 3.12 stable ABI)."""
    root = cache / "py313"
    if not (root / "usr/include/python3.13/Python.h").is_file():
        lists = cache / "apt-lists"
        (lists / "partial").mkdir(parents=True, exist_ok=True)
        # The machine's own Debian mirror, with the suite that packages 3.13 headers.
        text = Path("/etc/apt/sources.list.d/debian.sources").read_text()
        mirror = re.search(r"^URIs:\s*(\S+)", text, re.M).group(1)
        sources = cache / "sources.list"
        sources.write_text(f"deb {mirror} {ABI3_SUITE} main\n")
        opts = [f"-oDir::Etc::SourceList={sources}", "-oDir::Etc::SourceParts=/dev/null",
                f"-oDir::State::Lists={lists}", "-oAPT::Sandbox::User=root", "-qq"]
        subprocess.run(["apt-get", *opts, "update"], check=True)
        debs = cache / "debs"
        debs.mkdir(exist_ok=True)
        subprocess.run(["apt-get", *opts, "download", f"{ABI3_DEB}/{ABI3_SUITE}"], cwd=debs, check=True)
        for deb in debs.glob(f"{ABI3_DEB}_*.deb"):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    return [str(root / "usr/include/python3.13"), str(root / "usr/include")]


def compile_ext(src: Path, nb: Path, out: Path, includes: list[str], abi3: bool) -> None:
    """The flags nanobind_add_module(NOMINSIZE) uses in a Release build, as one g++ call.

    libstdc++ is linked statically, so the module does not need the host's to be as new as this machine's.
    """
    defs = ["-DNDEBUG", "-DNB_COMPACT_ASSERTIONS"] + (["-DPy_LIMITED_API=0x030C0000"] if abi3 else [])
    cmd = ["g++", "-std=c++20", "-O3", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing",
           "-fno-stack-protector", *defs, *(f"-I{d}" for d in includes),
           f"-I{nb}/include", f"-I{nb}/ext/robin_map/include",
           str(nb / "src/nb_combined.cpp"), str(src / "csrc/suffix_decoding/bindings.cc"),
           str(src / "csrc/suffix_decoding/suffix_tree.cc"),
           "-static-libstdc++", "-static-libgcc", "-Wl,-s", "-o", str(out)]
    subprocess.run(cmd, check=True)  # Python's own symbols stay undefined: the interpreter provides them


def pack(src: Path, so: Path, tag: str, out_dir: Path) -> Path:
    """Write the wheel: the package's suffix_decoding files, the extension, and dist-info with RECORD."""
    dist = f"arctic_inference-{VERSION}+suffix"
    files = {
        "arctic_inference/__init__.py": (src / "arctic_inference/__init__.py").read_bytes(),
        "arctic_inference/suffix_decoding/__init__.py":
            (src / "arctic_inference/suffix_decoding/__init__.py").read_bytes(),
        "arctic_inference/suffix_decoding/cache.py": (src / "arctic_inference/suffix_decoding/cache.py").read_bytes(),
        f"arctic_inference/suffix_decoding/{so.name}": so.read_bytes(),
        f"{dist}.dist-info/LICENSE": (src / "LICENSE").read_bytes(),
        f"{dist}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: arctic_inference\nVersion: {VERSION}+suffix\n"
            "Summary: Snowflake Arctic Inference, suffix decoding only (built by batchjson)\n"
            "License: Apache-2.0\nRequires-Python: >=3.10\nRequires-Dist: numpy\n").encode(),
        f"{dist}.dist-info/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: batchjson arctic_wheel.py\nRoot-Is-Purelib: false\nTag: {tag}\n").encode(),
    }
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = out_dir / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2026, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            zf.writestr(info, data, zipfile.ZIP_DEFLATED)
    return wheel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--abi3", action="store_true", help="build cp312-abi3 (CPython >= 3.12) instead of this Python")
    args = parser.parse_args()
    cache = Path(os.environ.get("BUNDLE_CACHE", "/tmp/batchjson-bundle")) / "arctic"
    cache.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    src, nb = download(cache)
    if args.abi3:
        includes, suffix, tag = abi3_includes(cache), ".abi3.so", "cp312-abi3-linux_x86_64"
    else:
        py = f"cp{sys.version_info.major}{sys.version_info.minor}"
        includes, suffix = [sysconfig.get_paths()["include"]], sysconfig.get_config_var("EXT_SUFFIX")
        tag = f"{py}-{py}-linux_x86_64"
    build = cache / f"build-{tag}"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir()
    so = build / f"_C{suffix}"
    compile_ext(src, nb, so, includes, args.abi3)
    print(pack(src, so, tag, args.out_dir))


if __name__ == "__main__":
    main()
