"""The ``transformers`` system of the benchmarks: the same checkpoint run by transformers itself.

What offloading costs is measured against the model as transformers runs it with every expert in
memory on the same device: same checkpoint, same prompt, same number of tokens, greedy, the EOS
ignored. It runs in a process of its own (``python -m bench.plain_transformers CHECKPOINT``),
started once and kept up, so that the benchmarks interleave it request by request with the
other systems (``TransformersSystem``, the parent's side). The child reads one JSON request per
line on stdin, ``{"tokens": N, "prompt": [ids]}``, and answers one line on stdout,
``{"latencies_s": [...], "first_s": s, "cpu_s": s, "tokens": [...], "margins": [...]}``: the time
of each decode token (a forward over the previous token with transformers' own KV cache, and the
greedy pick, which waits for the device), the process's CPU seconds over the request, and the
tokens it picked (the first included) with each pick's top-2 logit margin (taken after the
timing), which ``bench.llama_cpp`` checks llama.cpp's greedy tokens against. The router picks the experts (no
forced routing): the arithmetic per token is the same, top-k experts per layer. An MXFP4
checkpoint is dequantised to bf16 by transformers when it loads (no Triton kernels here).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.confine import Confinement  # noqa: E402
from bench.usage import ask_line_process, end_line_process, record_answer  # noqa: E402


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def top2_margin(logits) -> float:
    """The gap between the highest and the second highest logit: how near the greedy pick was to
    a tie (what another system's rounding can flip)."""
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def serve(checkpoint: Path, device: str, threads: int, dtype: str = "bfloat16") -> None:
    """The child: load (the weights and the arithmetic in ``dtype``), then answer requests on
    stdin until it closes."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from compute_svc.engine.kv_cache import cache_keyword

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype)).to(device).eval()
    keyword = cache_keyword(model)
    print(
        json.dumps(
            {"ready": True, "experts_implementation": getattr(model.config, "_experts_implementation", None)}
        ),
        flush=True,
    )
    for line in sys.stdin:
        request = json.loads(line)
        tokens, prompt = int(request["tokens"]), [int(t) for t in request["prompt"]]
        cpu0 = cpu_seconds()
        latencies, picked, margins = [], [], []
        with torch.inference_mode():
            started = time.perf_counter()
            cache = DynamicCache(config=model.config)
            out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True, **{keyword: cache})
            token = int(out.logits[0, -1].argmax())
            first = time.perf_counter() - started
            picked.append(token)
            margins.append(top2_margin(out.logits[0, -1]))
            for _ in range(tokens - 1):
                started = time.perf_counter()
                out = model(
                    input_ids=torch.tensor([[token]], device=device), use_cache=True, **{keyword: cache}
                )
                token = int(out.logits[0, -1].argmax())  # waits for the device
                latencies.append(time.perf_counter() - started)
                picked.append(token)
                margins.append(top2_margin(out.logits[0, -1]))  # after the timing: not part of it
        print(
            json.dumps(
                {
                    "latencies_s": latencies,
                    "first_s": first,
                    "cpu_s": cpu_seconds() - cpu0,
                    "tokens": picked,
                    "margins": margins,
                }
            ),
            flush=True,
        )


class TransformersSystem:
    """The parent's side: the child started once; ``measure`` runs one request in it. The same
    interface as ``bench.systems.ProcessSystem`` (begin / measure / finish / stop)."""

    system = "transformers"

    def __init__(
        self,
        checkpoint: Path,
        *,
        device: str,
        threads: int,
        tokens: int,
        prompt: tuple[int, ...],
        dtype: str = "bfloat16",
        memory: Confinement | None = None,
    ) -> None:
        """``dtype``: what the child computes in (the benchmarks' system: bfloat16, as the
        checkpoint is; ``bench.llama_cpp``'s greedy check also runs float32). ``memory``: the
        cgroup it runs in, limited once the model is loaded (every expert in memory)."""
        self.memory = memory or Confinement(self.system, enabled=False)
        self.tokens, self.prompt = tokens, prompt
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        self.proc = subprocess.Popen(
            self.memory.command(
                [
                    sys.executable,
                    "-m",
                    "bench.plain_transformers",
                    str(checkpoint),
                    "--device",
                    device,
                    "--threads",
                    str(threads),
                    "--dtype",
                    dtype,
                ]
            ),
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = self._read()
        self.memory.limit(0)  # loaded: every expert is in its baseline
        self.experts_implementation = hello.get("experts_implementation")
        self.latencies: list[float] = []
        self.first_token: list[float] = []
        self.by_repeat: dict[int, list[float]] = {}
        self.cpu_s = 0.0
        self.generated = 0

    def _read(self) -> dict:
        return ask_line_process(self.proc, None, "bench.plain_transformers")

    def generate(self) -> dict:
        request = json.dumps({"tokens": self.tokens, "prompt": list(self.prompt)})
        return ask_line_process(self.proc, request, "bench.plain_transformers")

    def begin(self) -> None:
        # warm-up, not measured (first calls allocate and pick kernels); its greedy tokens kept
        self.reference = self.generate()
        self.cpu_s, self.generated = 0.0, 0

    def measure(self, repeat: int, r: int) -> None:
        del r
        got = self.generate()
        record_answer(self, got, repeat)

    def finish(self) -> dict:
        return {
            "latencies_s": self.latencies,
            "latencies_by_repeat_s": [self.by_repeat[k] for k in sorted(self.by_repeat)],
            "first_token_s": self.first_token,
            "cpu_s_per_token": {"transformers": self.cpu_s / max(1, self.generated)},
            "experts_implementation": self.experts_implementation,
            "greedy_tokens": getattr(self, "reference", {}).get("tokens", []),
            "memory": self.memory.report(),
        }

    def stop(self, dump_logs: bool = False) -> None:
        del dump_logs
        end_line_process(self.proc)
        self.memory.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    serve(args.checkpoint, args.device, args.threads, args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
