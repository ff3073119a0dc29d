"""The ``llama.cpp`` system of the benchmarks: the same checkpoint run by llama.cpp, every expert in
memory, beside ours.

    make llama-cpp                           # builds it once (about 10 minutes on 2 cores)
    python -m bench.llama_cpp build [--jobs 2] [--dir .tools/llama.cpp] [--sdist FILE]
    python -m bench.llama_cpp status         # built, or why not (one line)
    python -m bench.llama_cpp convert CHECKPOINT OUT.gguf --outtype bf16

Built from the source distribution of ``llama-cpp-python`` (``VERSION``), which vendors llama.cpp
and its converter: ``pip download --no-deps --no-binary :all: llama-cpp-python==VERSION``,
unpacked under ``.tools/llama.cpp/`` (git-ignored; ``EXPERTCACHE_LLAMA_CPP_DIR`` moves it), its
``vendor/llama.cpp`` built with CMake for the CPU only (Release, ``-DGGML_NATIVE=ON``, shared
libraries, the library alone: no tools, examples, tests or server), ``-j2``. The benchmarks drive it
with a small program built beside it (``bench/llama_cpp_driver.cpp`` against ``llama.h``, linked to
that ``libllama``): loaded once and kept up, it answers one request per line with each decode
token's time (``llama_decode`` of one token and the greedy pick, timed one by one; the prefill
left out) and the tokens it picked. Not the ``llama_cpp`` Python package of the sdist: a C++ loop
measures llama.cpp itself, with no Python binding's cost in the per-token time, and depends on
``llama.h`` alone, not on a ctypes mirror of its structs.

The checkpoint is converted once with the converter of the same sdist
(``vendor/llama.cpp/convert_hf_to_gguf.py``, with the gguf-py vendored beside it first on
``sys.path``): bf16 experts to ``--outtype bf16``; MXFP4 experts stay MXFP4 (the converter repacks
gpt-oss' ``*_blocks`` / ``*_scales`` into ggml's MXFP4 blocks as they are; the dense weights
bf16). The GGUF is cached next to the checkpoint (``llama.cpp-VERSION-PRECISION.gguf``), with a
summary of its tensors' bytes by type beside it (``.json``). The checkpoint's tokenizer is the
small byte-level BPE ``devtools.tiny`` trains, whose pre-tokenizer the converter does not know by
its hash: it is written as ``gpt-2`` (a byte-level BPE with GPT-2's split, which it is). The
benchmarks give token ids, so no tokenizer runs anyway.

Where llama.cpp is not built (``make llama-cpp`` not run, no compiler, no sdist, a failed build),
the benchmarks say so in one line and run the rest; they never build it themselves (the make
targets ``bench-e2e`` and ``bench-overhead`` build it first, going on without it where that fails).
``EXPERTCACHE_LLAMA_CPP=off`` leaves it out even where it is built.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.confine import Confinement  # noqa: E402
from bench.report import MIB, say  # noqa: E402
from bench.usage import ask_line_process, end_line_process, record_answer  # noqa: E402

SYSTEM = "llama.cpp"
# The same GGUF run by llama.cpp from its memory map (no repacked copy), held to the experts'
# budget of the cache's systems: it pages experts in from the file as its routers pick them.
BUDGETED = "llama.cpp-budget"
SYSTEMS = (SYSTEM, BUDGETED)
VERSION = "0.3.36"  # llama-cpp-python's sdist
DEFAULT_DIR = REPO / ".tools" / "llama.cpp"
DIR_ENV = "EXPERTCACHE_LLAMA_CPP_DIR"
OFF_ENV = "EXPERTCACHE_LLAMA_CPP"  # "off": never run
DRIVER_SOURCE = Path(__file__).resolve().with_name("llama_cpp_driver.cpp")
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=ON",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
    "-DLLAMA_BUILD_COMMON=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
# --precision → the converter's --outtype: bf16 experts to BF16; MXFP4 experts are repacked as
# they are whatever the outtype (it is the dense weights', kept bf16 as the checkpoint has them).
OUTTYPES = {"bf16": "bf16", "mxfp4": "bf16"}
CHECK_TOKENS = 16  # llama.cpp's first greedy tokens checked against transformers'


class Unavailable(Exception):
    """llama.cpp cannot be built or run here; the message is the one line that says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(" ".join(str(reason).split()))  # one line, whatever the cause's text


@dataclass(frozen=True)
class Paths:
    root: Path

    @property
    def downloads(self) -> Path:
        return self.root / "dl"

    @property
    def source(self) -> Path:  # the unpacked sdist
        return self.root / f"llama_cpp_python-{VERSION}"

    @property
    def vendor(self) -> Path:  # llama.cpp as the sdist vendors it
        return self.source / "vendor" / "llama.cpp"

    @property
    def converter(self) -> Path:
        return self.vendor / "convert_hf_to_gguf.py"

    @property
    def build(self) -> Path:
        return self.root / "build"

    @property
    def lib_dir(self) -> Path:
        return self.build / "bin"

    @property
    def driver(self) -> Path:
        return self.root / "bin" / "expertcache-llama-driver"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    @property
    def failed(self) -> Path:  # the one line of the last failed build
        return self.root / "build-failed.txt"

    @property
    def info(self) -> Path:  # what was built, and how
        return self.root / "build-info.json"


def paths(root: Path | None = None) -> Paths:
    return Paths(Path(root or os.environ.get(DIR_ENV) or DEFAULT_DIR))


def status(root: Path | None = None) -> str | None:
    """None where llama.cpp is built and can run, else the one line that says why not."""
    if os.environ.get(OFF_ENV, "").lower() in ("off", "0", "no", "false"):
        return f"left out ({OFF_ENV}={os.environ[OFF_ENV]})"
    p = paths(root)
    if p.failed.is_file() and not p.driver.is_file():
        reason = p.failed.read_text().strip() or "unknown reason"
        return f"cannot be built here: {reason} (`make llama-cpp` tries again)"
    if not p.driver.is_file() or not p.info.is_file():
        return (
            f"not built in {p.root} (`make llama-cpp` builds it from the llama-cpp-python {VERSION} sdist, "
            "about 10 minutes on 2 cores)"
        )
    if DRIVER_SOURCE.stat().st_mtime > p.driver.stat().st_mtime:
        return f"its driver is older than {DRIVER_SOURCE.name} (`make llama-cpp` rebuilds it, seconds)"
    if not p.converter.is_file():
        return f"the converter {p.converter} is missing (`make llama-cpp` unpacks the sdist again)"
    return None


def choose(systems: list[str], root: Path | None = None) -> tuple[list[str], str | None]:
    """``systems`` as they can run: without llama.cpp (``SYSTEMS``) where it cannot (with the line
    that says why), unchanged otherwise (None)."""
    if not set(SYSTEMS) & set(systems):
        return systems, None
    reason = status(root)
    if reason is None:
        return systems, None
    return [s for s in systems if s not in SYSTEMS], f"{SYSTEM}: not run: {reason}"


# -- building ----------------------------------------------------------------------------------------


def _tool(name: str, env: str | None = None) -> str:
    """The path of ``name`` (the environment's own first, e.g. the .venv's cmake), or Unavailable."""
    if env and os.environ.get(env):
        found = shutil.which(os.environ[env])
        if found:
            return found
    bin_dir = str(Path(sys.executable).parent)
    found = shutil.which(name, path=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]))
    if not found:
        raise Unavailable(f"no {name} on PATH")
    return found


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    raise Unavailable("no C++ compiler (c++, g++ or clang++; or $CXX) on PATH")


def _run(cmd: list[str], log: Path, what: str, cwd: Path | None = None) -> None:
    """``cmd`` with its output appended to ``log``; Unavailable naming ``what`` and its last error."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    if done.returncode != 0:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()] or lines
        raise Unavailable(
            f"{what} failed (exit {done.returncode}; {log}): {errors[-1][:200] if errors else ''}"
        )


def _sdist(p: Paths, sdist: Path | None) -> Path:
    """The sdist's tarball: ``sdist``, one downloaded before, or ``pip download``'s."""
    if sdist is not None:
        if not sdist.is_file():
            raise Unavailable(f"the sdist {sdist} does not exist")
        return sdist
    name = f"llama_cpp_python-{VERSION}.tar.gz"
    if (p.downloads / name).is_file():
        return p.downloads / name
    p.downloads.mkdir(parents=True, exist_ok=True)
    say(f"llama.cpp: downloading the llama-cpp-python {VERSION} sdist into {p.downloads}")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    _run([*cmd, f"llama-cpp-python=={VERSION}", "-d", str(p.downloads)], p.log, "pip download")
    if not (p.downloads / name).is_file():
        raise Unavailable(f"pip download left no {name} in {p.downloads}")
    return p.downloads / name


def _unpack(p: Paths, tarball: Path) -> None:
    if p.converter.is_file() and (p.vendor / "include" / "llama.h").is_file():
        return
    say(f"llama.cpp: unpacking {tarball.name} into {p.root}")
    shutil.rmtree(p.source, ignore_errors=True)
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(p.root, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise Unavailable(f"the sdist {tarball} could not be unpacked: {exc}") from None
    if not (p.vendor / "CMakeLists.txt").is_file() or not p.converter.is_file():
        raise Unavailable(f"the sdist {tarball} has no vendor/llama.cpp with its converter")


def build(root: Path | None = None, *, jobs: int = 2, sdist: Path | None = None) -> Paths:
    """Download (once), unpack and build llama.cpp and the driver; Unavailable with the reason
    where it cannot (also written to ``build-failed.txt``, which ``status`` reports)."""
    p = paths(root)
    if sdist is None and status(p.root) is None:
        info = json.loads(p.info.read_text())
        if info.get("cmake_flags") == list(CMAKE_FLAGS) and info.get("llama_cpp_python") == VERSION:
            say(f"llama.cpp: already built in {p.root} ({p.driver})")
            return p
    p.root.mkdir(parents=True, exist_ok=True)
    p.log.write_text(f"llama.cpp build, llama-cpp-python {VERSION}, {time.ctime()}\n")
    started = time.perf_counter()
    try:
        cmake, cxx = _tool("cmake", "CMAKE"), _compiler()
        _unpack(p, _sdist(p, sdist))
        say(f"llama.cpp: building {p.vendor} into {p.build} (CPU, native, Release, -j{jobs}; log {p.log})")
        _run([cmake, "-S", str(p.vendor), "-B", str(p.build), *CMAKE_FLAGS], p.log, "cmake configure")
        _run(
            [cmake, "--build", str(p.build), "--config", "Release", "-j", str(jobs), "--target", "llama"],
            p.log,
            "cmake build",
        )
        libs = sorted(x.name for x in p.lib_dir.glob("lib*.so*"))
        if "libllama.so" not in libs:
            raise Unavailable(f"the build left no libllama.so in {p.lib_dir}")
        p.driver.parent.mkdir(parents=True, exist_ok=True)
        say(f"llama.cpp: compiling the driver {DRIVER_SOURCE.name} into {p.driver}")
        _run(
            [
                cxx,
                "-O2",
                "-std=c++17",
                f"-I{p.vendor / 'include'}",
                f"-I{p.vendor / 'ggml' / 'include'}",
                str(DRIVER_SOURCE),
                "-o",
                str(p.driver),
                f"-L{p.lib_dir}",
                "-lllama",
                f"-Wl,-rpath,{p.lib_dir}",
            ],
            p.log,
            "compiling the driver",
        )
    except Unavailable as exc:
        p.failed.write_text(f"{exc}\n")
        p.driver.unlink(missing_ok=True)
        raise
    p.failed.unlink(missing_ok=True)
    info = {
        "llama_cpp_python": VERSION,
        "vendor": str(p.vendor),
        "cmake_flags": list(CMAKE_FLAGS),
        "jobs": jobs,
        "compiler": cxx,
        "libraries": libs,
        "driver": str(p.driver),
        "build_s": time.perf_counter() - started,
    }
    p.info.write_text(json.dumps(info, indent=1))
    say(f"llama.cpp: built in {info['build_s']:.0f} s: {p.driver}, {', '.join(libs)}")
    return p


# -- converting ----------------------------------------------------------------------------------


def gguf_path(checkpoint: Path, precision: str) -> Path:
    """Where the GGUF of ``checkpoint`` at ``precision`` is cached: next to it."""
    return checkpoint.parent / f"llama.cpp-{VERSION}-{precision}.gguf"


def convert(checkpoint: Path, precision: str, root: Path | None = None) -> tuple[Path, dict]:
    """The GGUF of ``checkpoint`` (converted once by the sdist's converter, in a process of its
    own) and the summary of its tensors' bytes."""
    if precision not in OUTTYPES:
        raise Unavailable(f"no GGUF conversion for experts in {precision} (only {', '.join(OUTTYPES)})")
    p = paths(root)
    out = gguf_path(checkpoint, precision)
    summary_path = out.with_suffix(".json")
    if out.is_file() and summary_path.is_file():
        return out, json.loads(summary_path.read_text())
    partial = out.with_name(out.name + ".partial")
    log = out.with_suffix(".log")
    say(
        f"llama.cpp: converting {checkpoint} with {p.converter.relative_to(p.root)} "
        f"(--outtype {OUTTYPES[precision]}) into {out}"
    )
    started = time.perf_counter()
    cmd = [sys.executable, "-m", "bench.llama_cpp", "convert", str(checkpoint), str(partial)]
    cmd += ["--outtype", OUTTYPES[precision], "--dir", str(p.root)]
    with log.open("w") as err:
        done = subprocess.run(cmd, cwd=REPO, stdout=err, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not partial.is_file():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        partial.unlink(missing_ok=True)
        raise Unavailable(
            f"the conversion to GGUF failed (exit {done.returncode}; {log}): {lines[-1] if lines else ''}"
        )
    summary = json.loads(partial.with_suffix(".json").read_text())
    partial.with_suffix(".json").unlink()
    summary["convert_s"] = time.perf_counter() - started
    partial.rename(out)
    summary_path.write_text(json.dumps(summary, indent=1))
    say(f"llama.cpp: converted in {summary['convert_s']:.0f} s")
    return out, summary


def _convert_here(checkpoint: Path, out: Path, outtype: str, p: Paths) -> None:
    """The converter's own main, run in this process with the vendored gguf-py first on the path;
    the summary of the GGUF written beside ``out`` (``.json``)."""
    sys.path[:0] = [str(p.vendor / "gguf-py"), str(p.vendor)]
    import conversion.base as base  # the vendored converter's package

    recognise = base.TextModel.get_vocab_base_pre

    def vocab_base_pre(self, tokenizer) -> str:
        try:
            return recognise(self, tokenizer)
        except NotImplementedError:  # devtools.tiny's byte-level BPE: GPT-2's split
            print("bench.llama_cpp: the BPE pre-tokenizer is not one the converter knows: written as 'gpt-2'")
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = vocab_base_pre
    import convert_hf_to_gguf
    import gguf

    sys.argv = ["convert_hf_to_gguf.py", str(checkpoint), "--outfile", str(out), "--outtype", outtype]
    convert_hf_to_gguf.main()
    reader = gguf.GGUFReader(out)
    by_type: dict[str, int] = {}
    experts: dict[str, int] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        by_type[kind] = by_type.get(kind, 0) + int(tensor.n_bytes)
        if "_exps." in tensor.name:
            experts[kind] = experts.get(kind, 0) + int(tensor.n_bytes)
    summary = {
        "file_bytes": out.stat().st_size,
        "tensor_bytes_by_type": by_type,
        "expert_bytes_by_type": experts,
        "expert_bytes": sum(experts.values()),
        "outtype": outtype,
        "converter": str(p.converter),
        "gguf_py": str(p.vendor / "gguf-py"),
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))


def bytes_line(summary: dict, store_bytes: int, store_expert_bytes: int) -> str:
    """The GGUF's bytes beside the store's."""
    experts = ", ".join(f"{k} {v / MIB:.1f} MiB" for k, v in summary["expert_bytes_by_type"].items())
    return (
        f"llama.cpp: GGUF {summary['file_bytes'] / MIB:.1f} MiB (experts {summary['expert_bytes'] / MIB:.1f} MiB: "
        f"{experts}) beside the store's {store_bytes / MIB:.1f} MiB (experts {store_expert_bytes / MIB:.1f} MiB)"
    )


# -- running -------------------------------------------------------------------------------------


def read_ahead_text(path: Path) -> str:
    """The read-ahead of the block device holding ``path`` (what a page fault on a mapped file
    reads around the page), as the kernel sets it, or why it is not known."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return "not known"
    queue = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for candidate in (queue / "queue" / "read_ahead_kb", queue / ".." / "queue" / "read_ahead_kb"):
        try:
            return f"{int(candidate.read_text())} KiB ({candidate.resolve().parent.parent.name})"
        except (OSError, ValueError):
            continue
    return "not known"


class LlamaCppSystem:
    """llama.cpp's driver on the GGUF, started once and kept up; ``measure`` runs one request in
    it. The interface of ``bench.systems.ProcessSystem`` (begin / measure / finish / stop)."""

    def __init__(
        self,
        gguf: Path,
        summary: dict,
        *,
        threads: int,
        tokens: int,
        prompt: tuple[int, ...],
        root: Path | None = None,
        memory: Confinement | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        """``memory``: the cgroup it runs in. Its budget is the GGUF's bytes (repacked into
        memory at load, or mapped and paged in by the warm-up request); with ``budget_bytes``
        (``BUDGETED``) the GGUF's dense bytes + ``budget_bytes`` of experts, the weights used
        where they are mapped, so that the experts beyond it are paged in from the file."""
        self.system = SYSTEM if budget_bytes is None else BUDGETED
        self.tokens, self.prompt, self.gguf, self.summary = tokens, prompt, gguf, summary
        self.memory = memory or Confinement(self.system, enabled=False)
        self.threads = threads
        if budget_bytes is None:
            how = "every expert in memory (mmap, paged in by a warm-up request)"
            budget = summary["file_bytes"]
        else:
            dense = summary["file_bytes"] - summary["expert_bytes"]
            how = (
                f"from its memory map (no repacking), held to the GGUF's dense {dense / MIB:.1f} MiB + the "
                f"experts' budget {budget_bytes / MIB:.0f} MiB: experts beyond it page in from the file "
                f"(read-ahead per fault: {read_ahead_text(gguf)}), {tokens} tokens a request"
            )
            budget = dense + budget_bytes
        say(
            f"[{self.system}] {gguf.name} by llama.cpp (llama-cpp-python {VERSION}'s), CPU, {threads} thread(s), "
            f"{how}, greedy, its own router"
        )
        n_ctx = -(-(len(prompt) + tokens) // 256) * 256
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [str(paths(root).driver), str(gguf), str(threads), str(n_ctx)]
        self.proc = subprocess.Popen(
            self.memory.command(cmd if budget_bytes is None else [*cmd, "mapped"]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        hello = self._read()
        self.memory.limit(budget, ("shmem", "mapped_file"))  # the GGUF mapped so far is the budget's
        self.system_info = hello.get("system_info", "")
        self.latencies: list[float] = []
        self.first_token: list[float] = []
        self.by_repeat: dict[int, list[float]] = {}
        self.picked: list[list[int]] = []
        self.cpu_s, self.generated = 0.0, 0
        self.read_bytes = 0
        self.cached_at_start: int | None = None  # of the GGUF, as the budgeted one started

    def _read(self) -> dict:
        return ask_line_process(self.proc, None, "the llama.cpp driver")

    def generate(self) -> dict:
        request = " ".join(str(t) for t in (self.tokens, *self.prompt))
        return ask_line_process(self.proc, request, "the llama.cpp driver")

    def begin(self) -> None:
        self.picked.append(self.generate()["tokens"])  # warm-up, not measured (pages the GGUF in)
        self.cpu_s, self.generated, self.read_bytes = 0.0, 0, 0

    def measure(self, repeat: int, r: int) -> None:
        del r
        before = self._read_bytes()
        got = self.generate()
        record_answer(self, got, repeat)
        self.picked.append(got["tokens"])
        self.read_bytes += self._read_bytes() - before

    def _read_bytes(self) -> int:
        """The bytes the driver has had read from storage (``read_bytes`` of /proc/PID/io: its
        page faults on the mapped GGUF and their readahead); 0 where the kernel does not say."""
        try:
            with open(f"/proc/{self.proc.pid}/io") as f:
                return next((int(line.split()[1]) for line in f if line.startswith("read_bytes:")), 0)
        except OSError:
            return 0

    def finish(self) -> dict:
        return {
            "latencies_s": self.latencies,
            "latencies_by_repeat_s": [self.by_repeat[k] for k in sorted(self.by_repeat)],
            "first_token_s": self.first_token,
            "cpu_s_per_token": {self.system: self.cpu_s / max(1, self.generated)},
            # read from storage per generated token (the prompt's included): the paging of the GGUF
            "bytes_per_token": self.read_bytes / max(1, self.generated),
            "greedy_tokens": self.picked[0] if self.picked else [],
            "same_tokens_every_request": all(p == self.picked[0] for p in self.picked),
            "gguf": str(self.gguf),
            "gguf_bytes": self.summary["file_bytes"],
            "gguf_expert_bytes": self.summary["expert_bytes"],
            "gguf_expert_bytes_by_type": self.summary["expert_bytes_by_type"],
            "gguf_cached_bytes_at_start": self.cached_at_start,
            "threads": self.threads,
            "system_info": self.system_info,
            "llama_cpp_python": VERSION,
            "memory": self.memory.report(),
        }

    def stop(self, dump_logs: bool = False) -> None:
        del dump_logs
        end_line_process(self.proc)
        self.memory.remove()


# -- reporting -----------------------------------------------------------------------------------

WHY_ROUNDING = (
    "llama.cpp keeps activations in f32 but rounds them to bf16 for its bf16 matmuls and sums in "
    "its own order; transformers here computes in bf16 throughout"
)
WHY_ROUNDING_MXFP4 = (
    "; with MXFP4 experts llama.cpp multiplies them with activations quantised to 8 bits (Q8_0 "
    "blocks), while transformers decodes them to bf16 and multiplies bf16 activations"
)


def _prefix(a: list[int], b: list[int], n: int) -> int:
    """How many of the first ``n`` tokens ``a`` and ``b`` share before they differ."""
    n = min(n, len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def greedy_check(llama_tokens: list[int], references: dict | None, precision: str, n: int) -> dict:
    """llama.cpp's first ``n`` greedy tokens against transformers' (``references``: dtype → its
    answer with ``tokens`` and ``margins``, the top-2 logit gap of each pick; "bfloat16" as the
    benchmarks run it, "float32" the same weights with f32 arithmetic), printed, with why they
    differ where they do: transformers against itself in the other precision shows whether
    rounding alone decides this checkpoint's tokens."""
    bf16 = (references or {}).get("bfloat16")
    if not bf16 or not bf16.get("tokens"):
        say(f"{SYSTEM} greedy tokens: not checked (no transformers tokens)")
        return {"checked": False}
    f32 = references.get("float32")
    n = min(n, len(llama_tokens), len(bf16["tokens"]))
    mine, theirs = llama_tokens[:n], bf16["tokens"][:n]
    same = _prefix(mine, theirs, n)
    out = {"checked": True, "n": n, "agree": same == n, "agreeing_prefix": same, "llama_cpp": mine}
    out["transformers"] = theirs
    if f32 and f32.get("tokens"):
        out["transformers_float32"] = f32["tokens"][:n]
        out["agreeing_prefix_float32"] = _prefix(mine, f32["tokens"], n)
        out["transformers_bf16_vs_float32_prefix"] = _prefix(theirs, f32["tokens"], n)
    if same == n:
        say(f"{SYSTEM} greedy tokens: the first {n} agree with transformers' ({mine[:8]}...)")
        return out
    margins = bf16.get("margins") or []
    margin = margins[same] if same < len(margins) else None
    out["transformers_margin_at_divergence"] = margin
    say(
        f"{SYSTEM} greedy tokens: agree with transformers' (bf16) on the first {same} of {n}, then differ at "
        f"token {same} (llama.cpp {mine[same]}, transformers {theirs[same]}"
        + (f"; transformers' top-2 logit margin there {margin:.3f}" if margin is not None else "")
        + "); every later token continues from different tokens"
    )
    rounding = WHY_ROUNDING + (WHY_ROUNDING_MXFP4 if precision == "mxfp4" else "")
    self_prefix = out.get("transformers_bf16_vs_float32_prefix")
    if self_prefix is None:
        why = f"not told apart (no float32 run of transformers); the two round differently: {rounding}"
    elif self_prefix < n:
        why = (
            f"they cannot be expected to agree on this checkpoint: transformers itself, same weights with f32 "
            f"arithmetic instead of bf16, agrees with its bf16 run on only the first {self_prefix} of {n} tokens "
            f"(llama.cpp agrees with that f32 run on the first {out['agreeing_prefix_float32']}). The random "
            f"weights amplify rounding over the layers, so rounding alone picks the tokens, and the two round "
            f"differently: {rounding}"
        )
    else:
        why = (
            f"transformers agrees with itself in f32 arithmetic on all {n} tokens, so rounding does not explain "
            f"the difference (llama.cpp agrees with the f32 run on the first {out['agreeing_prefix_float32']}): "
            "the converted model may differ from the checkpoint"
        )
    out["why"] = why
    say(f"{SYSTEM} greedy tokens: why: {why}")
    return out


def references(
    checkpoint: Path, have: dict | None, *, device: str, threads: int, tokens: int, prompt: tuple[int, ...]
) -> dict:
    """transformers' greedy tokens (and top-2 margins) on ``checkpoint`` in bf16 (``have``: the
    benchmark's own transformers' answer, where it ran) and with f32 arithmetic: one request each
    in a ``bench.plain_transformers`` process of its own."""
    from bench.plain_transformers import TransformersSystem

    out = {"bfloat16": have} if have else {}
    for dtype in ("bfloat16", "float32"):
        if dtype in out:
            continue
        say(f"{SYSTEM} greedy tokens: transformers' first {tokens} on {checkpoint}, {dtype} arithmetic")
        plain = TransformersSystem(
            checkpoint, device=device, threads=threads, tokens=tokens, prompt=prompt, dtype=dtype
        )
        try:
            out[dtype] = plain.generate()
        finally:
            plain.stop()
    return out


def report(results: dict, *, precision: str, references: dict | None, check_tokens: int) -> dict:
    """What is printed of llama.cpp after the table: resident / llama.cpp per-token p50 (per repeat),
    and its greedy tokens against transformers'. Adds ``p50_ms`` / ``p99_ms`` to its entry."""
    from bench.stats import repeat_ratios, spread_text

    out: dict = {}
    for system in SYSTEMS:
        if system in results:
            r = results[system]
            r["p50_ms"] = r["p50_s"] * 1e3 if r.get("p50_s") is not None else None
            r["p99_ms"] = r["p99_s"] * 1e3 if r.get("p99_s") is not None else None
            say(
                f"{system}: per-token p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms over {r['tokens']} decode "
                f"tokens ({r['threads']} thread(s), CPU {r['cpu_s_per_token'][system] * 1e3:.1f} ms per token); "
                f"GGUF {r['gguf_bytes'] / MIB:.1f} MiB"
            )
    if SYSTEM not in results:
        return out
    r = results[SYSTEM]
    if "resident" in results and r.get("p50_s") and results["resident"].get("p50_s"):
        value = results["resident"]["p50_s"] / r["p50_s"]
        per = repeat_ratios(results["resident"], r)
        out["resident_vs_llama_cpp"] = {"p50_ratio": value, "per_repeat": per}
        say(f"resident / llama.cpp per-token p50: {value:.3f}; per repeat {spread_text(per, '.3f')}")
    if check_tokens > 0:
        r["greedy_check"] = greedy_check(r.get("greedy_tokens", []), references, precision, check_tokens)
        out["llama_cpp_greedy_tokens_agree"] = r["greedy_check"].get("agree")
    return out


def checked_systems(parser, args, systems: list[str]) -> list[str]:
    """A benchmark's ``--systems`` without llama.cpp where it is not built (one line says why),
    after checking ``--check-tokens``; a parser error when nothing is left to run."""
    if args.check_tokens < 0:
        parser.error(f"--check-tokens must be >= 0, got {args.check_tokens}")
    systems, absent = choose(systems)  # not built here: said, and the rest run
    if absent:
        say(absent)
        if not systems:
            parser.error(f"--systems {args.systems!r}: nothing left to run without {SYSTEM}")
    return systems


def convert_or_drop(
    parser,
    args,
    systems: list[str],
    checkpoint: Path,
    precision: str,
    store_bytes: int,
    store_expert_bytes: int,
) -> tuple[Path, dict] | None:
    """The GGUF of ``checkpoint`` when llama.cpp is among ``systems`` (its bytes printed beside the
    store's); where it cannot be converted, one line says why and llama.cpp leaves ``systems``
    (a parser error when nothing is left)."""
    if not set(SYSTEMS) & set(systems):
        return None
    try:
        gguf = convert(checkpoint, precision)
    except Unavailable as exc:
        say(f"{SYSTEM}: not run: {exc}")
        systems[:] = [s for s in systems if s not in SYSTEMS]
        if not systems:
            parser.error(f"--systems {args.systems!r}: nothing left to run without {SYSTEM}")
        return None
    say(bytes_line(gguf[1], store_bytes, store_expert_bytes))
    return gguf


def check_and_report(
    results: dict,
    *,
    checkpoint: Path,
    have: dict | None,
    precision: str,
    device: str,
    threads: int,
    check_tokens: int,
    prompt: tuple[int, ...],
) -> dict:
    """``report``, with transformers' greedy tokens made first when ``check_tokens`` asks for them
    (``references``; ``have``: the benchmark's own transformers' answer, where it ran)."""
    refs = None
    if check_tokens and SYSTEM in results:
        refs = references(
            checkpoint, have, device=device, threads=threads, tokens=check_tokens, prompt=prompt
        )
    return report(results, precision=precision, references=refs, check_tokens=check_tokens)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download the sdist (once), build llama.cpp and the driver")
    b.add_argument("--jobs", type=int, default=2)
    b.add_argument("--dir", type=Path, default=None, help=f"default ${DIR_ENV} or {DEFAULT_DIR}")
    b.add_argument(
        "--sdist", type=Path, default=None, help="a llama-cpp-python sdist instead of pip download's"
    )
    s = sub.add_parser("status", help="built, or the line that says why not")
    s.add_argument("--dir", type=Path, default=None)
    c = sub.add_parser("convert", help="the vendored converter on a checkpoint (what the benchmarks run)")
    c.add_argument("checkpoint", type=Path)
    c.add_argument("out", type=Path)
    c.add_argument("--outtype", default="bf16")
    c.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.command == "build":
        if args.jobs < 1:
            parser.error(f"--jobs must be >= 1, got {args.jobs}")
        try:
            build(args.dir, jobs=args.jobs, sdist=args.sdist)
        except Unavailable as exc:
            say(f"{SYSTEM} cannot be built: {exc}")
            return 1
        return 0
    if args.command == "status":
        reason = status(args.dir)
        say(f"{SYSTEM}: {reason}" if reason else f"{SYSTEM}: built in {paths(args.dir).root}")
        return 1 if reason else 0
    _convert_here(args.checkpoint, args.out, args.outtype, paths(args.dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
