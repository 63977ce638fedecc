"""zllm-edge against llama.cpp on a MoE larger than the memory either may use: the same weights under
the same limit.

    python benchmarks/moe_vs_llama_cpp.py [--shape olmoe-1b-7b] [--budget 50%] [--threads 2]
        [--prompt-tokens 32] [--new-tokens 32] [--repeats 1] [--json FILE] [--plot FILE.png]

The random MoE of --shape (edge/random_moe.py: the sizes of a real MoE, random weights) is written
once as the GGUF file llama.cpp reads for a Mixtral (architecture "llama", experts stacked per
projection in blk.L.ffn_{gate,up,down}_exps): experts in Q4_0 holding exactly the INT4 codes and
float16 scales the shape's source draws, attention, embeddings and head in Q8_0, norms and routers
in F32. `zllm-edge convert --weights source` keeps the Q4_0 and Q8_0 blocks as they are, so both
engines run the same weights. Both files are cached under ZLLM_EDGE_HOME/bench-models/.

The limit is the zllm-edge process's memory budget (--budget: bytes, or P% of the expert bytes, as
`zllm-edge bench` takes it) plus the RSS of an interpreter that has imported the package (what a
budget is counted above). It is enforced the same way for both engines, from outside: before each
engine starts, the page cache is dropped and a helper process takes and touches all the memory
the machine has available beyond the limit (with no swap those pages cannot be taken back; with
swap it also locks them), so the engine has the limit for its own memory and the page cache
together. llama.cpp maps the GGUF (its default mmap) and pages experts in and out through the page
cache; zllm-edge streams them into its bounded cache with direct I/O, from the real disk (no
emulated storage here). Reported per engine: decode tokens/s after a --prompt-tokens prompt, peak
RSS, and the greedy tokens both engines agree on (random weights: near-ties can differ in the
last bits of two engines' sums).
"""
from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import time

import numpy as np

from report import publish

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from bench_envs import PeerUnavailable, ensure_env, llama_cpp_build  # noqa: E402
from peers import Contender, Worker  # noqa: E402

PAGE = mmap.PAGESIZE
Q4_0_BLOCK, Q8_0_BLOCK = 18, 34  # bytes per 32 values


# ---------------------------------------------------------------------------------- the GGUF


def _q4_0_blocks(tensor) -> np.ndarray:
    """An INT4 symmetric g32 QuantizedTensor [N, K] -> Q4_0 blocks uint8 [N, K / 32, 18] (same d and q)."""
    packed = tensor.qweight  # [N, G, 16]: code 2j in the low nibble of byte j, code 2j+1 in the high one
    codes = np.empty(packed.shape[:-1] + (32,), np.uint8)
    codes[..., 0::2], codes[..., 1::2] = packed & 0x0F, packed >> 4
    blocks = np.empty(packed.shape[:-1] + (Q4_0_BLOCK,), np.uint8)
    blocks[..., :2] = np.ascontiguousarray(tensor.scales.astype("<f2")).view(np.uint8).reshape(packed.shape[:-1] + (2,))
    blocks[..., 2:] = codes[..., :16] | (codes[..., 16:] << 4)  # GGML: element i low, element i + 16 high
    return blocks


def write_gguf(shape, path: str) -> None:
    """The random MoE of `shape` as a llama.cpp Mixtral GGUF at `path` (written to path + ".part" first)."""
    import gguf
    from tqdm import tqdm

    from edge.random_moe import RandomMoeSource, mixtral_config
    from quant.formats import Scheme

    Q4_0, Q8_0 = gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0
    config = mixtral_config(shape)
    source = RandomMoeSource(shape, Scheme("int4", 32, symmetric=True))
    d, inter, layers, experts = shape.hidden, shape.expert_intermediate, shape.layers, shape.experts
    head_dim = d // shape.heads
    writer = gguf.GGUFWriter(path + ".part", "llama")
    writer.add_block_count(layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(d)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(shape.vocab)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(shape.top_k)
    writer.add_tokenizer_model("gpt2")  # a placeholder vocabulary: the benchmark feeds ids
    writer.add_token_list(["a", "b", "ab"] + [f"<t{i}>" for i in range(shape.vocab - 3)])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])

    # (gguf name, how to make its data, byte shape, raw type or None for F32), in file order
    plan: list[tuple[str, object, tuple, object]] = []

    def q8(name: str, source_name: str, rows: int, cols: int) -> None:
        plan.append((name, lambda: gguf.quants.quantize(source.load(source_name), Q8_0),
                     (rows, cols // 32 * Q8_0_BLOCK), Q8_0))

    def f32(name: str, source_name: str, dims: tuple) -> None:
        plan.append((name, lambda: source.load(source_name).astype(np.float32), dims, None))

    def stacked(name: str, projection: str, layer: int, rows: int, cols: int) -> None:
        def make():
            return np.stack([_q4_0_blocks(source.load(f"model.layers.{layer}.mlp.experts.{e}.{projection}.weight"))
                             for e in range(experts)])
        plan.append((name, make, (experts, rows, cols // 32 * Q4_0_BLOCK), Q4_0))

    q8("token_embd.weight", "model.embed_tokens.weight", shape.vocab, d)
    for layer in range(layers):
        hf, blk = f"model.layers.{layer}.", f"blk.{layer}."
        f32(blk + "attn_norm.weight", hf + "input_layernorm.weight", (d,))
        q8(blk + "attn_q.weight", hf + "self_attn.q_proj.weight", shape.heads * head_dim, d)
        q8(blk + "attn_k.weight", hf + "self_attn.k_proj.weight", shape.kv_heads * head_dim, d)
        q8(blk + "attn_v.weight", hf + "self_attn.v_proj.weight", shape.kv_heads * head_dim, d)
        q8(blk + "attn_output.weight", hf + "self_attn.o_proj.weight", d, shape.heads * head_dim)
        f32(blk + "ffn_norm.weight", hf + "post_attention_layernorm.weight", (d,))
        f32(blk + "ffn_gate_inp.weight", hf + "mlp.gate.weight", (experts, d))
        stacked(blk + "ffn_gate_exps.weight", "gate_proj", layer, inter, d)
        stacked(blk + "ffn_up_exps.weight", "up_proj", layer, inter, d)
        stacked(blk + "ffn_down_exps.weight", "down_proj", layer, d, inter)
    f32("output_norm.weight", "model.norm.weight", (d,))
    q8("output.weight", "lm_head.weight", shape.vocab, d)

    for name, _, dims, raw in plan:
        dtype = np.uint8 if raw is not None else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize, raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, make, _, _ in tqdm(plan, desc=f"writing {os.path.basename(path)}", unit="tensor", file=sys.stderr):
        writer.write_tensor_data(make())
    writer.close()
    os.replace(path + ".part", path)


def build_models(shape_name: str) -> tuple[str, str]:
    """(the GGUF, the zllm checkpoint converted from it), built on first use."""
    from edge.random_moe import SHAPES
    from kernels.cache_home import zllm_home

    shape = SHAPES[shape_name]
    folder = os.path.join(zllm_home(), "bench-models", f"{shape.name}-gguf-q4_0")
    os.makedirs(folder, exist_ok=True)
    gguf_path, checkpoint = os.path.join(folder, "model.gguf"), os.path.join(folder, "zllm")
    if not os.path.isfile(gguf_path):
        print(f"writing {gguf_path} (first use)", file=sys.stderr)
        write_gguf(shape, gguf_path)
    if not os.path.isfile(os.path.join(checkpoint, "zllm.json")):
        print(f"converting it into {checkpoint} (first use)", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "edge.cli", "convert", gguf_path, checkpoint, "--weights", "source",
                        "--force"], check=True, cwd=os.path.dirname(HERE))
    return gguf_path, checkpoint


# ---------------------------------------------------------------------------------- the limit


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    return fields["MemAvailable"]


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root on Linux); False where that is not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


HOG = """
import mmap, sys
size = int(sys.argv[1])
block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
for offset in range(0, size, mmap.PAGESIZE):
    block[offset] = 1
try:
    import ctypes
    ctypes.CDLL(None).mlock(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(block))), ctypes.c_size_t(size))
except Exception:
    pass
print("ready", flush=True)
sys.stdin.read()
"""


class MemoryLimit:
    """While open: a helper process holding every available byte beyond `limit_bytes`."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.held_bytes = max(0, available_bytes() - limit_bytes) // PAGE * PAGE
        self.process = subprocess.Popen([sys.executable, "-c", HOG, str(self.held_bytes)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError("the memory-holding helper did not start")
        self.available_after = available_bytes()

    @property
    def held(self) -> bool:
        """Whether the helper still holds its memory (the kernel's OOM killer takes it first when an
        engine's own memory outgrows the limit)."""
        return self.process.poll() is None

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


# ---------------------------------------------------------------------------------- running


def run_engine(contender: Contender, threads: int, limit_bytes: int, prompt: list[int], new_tokens: int,
               repeats: int, log_dir: str) -> dict:
    dropped = drop_page_cache()
    limit = MemoryLimit(limit_bytes)
    try:
        started = time.perf_counter()
        worker = Worker(contender, threads, len(prompt) + new_tokens, log_dir, prompt)
        load_seconds = time.perf_counter() - started
        try:
            runs = [worker.run(prompt, new_tokens) for _ in range(repeats)]
        finally:
            peak = worker.stop()
        held = limit.held
    finally:
        limit.close()
    decode = [run["decode_steps"] / run["decode_seconds"] for run in runs]
    return {"engine": contender.engine, "options": contender.options, "limit_held": held,
            "page_cache_dropped": dropped, "held_bytes": limit.held_bytes,
            "available_bytes_while_held": limit.available_after, "load_and_warm_up_seconds": load_seconds,
            "decode_tokens_per_second": float(np.median(decode)), "runs": runs, "peak_rss_bytes": peak,
            "tokens": runs[0]["tokens"]}


def main(argv=None) -> int:
    from edge.random_moe import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="olmoe-1b-7b", choices=sorted(set(SHAPES) - {"stress"}))
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args(argv)

    import psutil

    gguf_path, checkpoint = build_models(args.shape)
    import edge

    imported = psutil.Process().memory_info().rss  # this interpreter after importing the package
    with edge.load(checkpoint, device="cpu", threads=args.threads, memory_budget=args.budget,
                   kv_capacity=args.prompt_tokens + args.new_tokens) as model:
        budget_bytes = model.memory.budget_bytes
        vocab = model.spec.vocab_size
    limit_bytes = budget_bytes + imported
    prompt = [int(i) for i in np.random.default_rng(0).integers(3, vocab, args.prompt_tokens)]
    log_dir = os.path.join(os.path.dirname(gguf_path), "logs")
    os.makedirs(log_dir, exist_ok=True)

    build = llama_cpp_build()
    try:
        llama_python = ensure_env(build.env, progress=lambda message: print(message, file=sys.stderr))
    except PeerUnavailable as exc:
        print(f"llama.cpp is not available: {exc}", file=sys.stderr)
        return 1
    zllm = Contender("MoE", "zllm-edge cpu", "zllm")
    zllm.python, zllm.model = sys.executable, checkpoint
    zllm.options = {"device": "cpu", "load_options": {"memory_budget": args.budget,
                                                      "kv_capacity": args.prompt_tokens + args.new_tokens}}
    llama = Contender("MoE", "llama.cpp", "llama_cpp")
    llama.python, llama.model, llama.options = llama_python, gguf_path, {}
    llama_mmap = Contender("MoE", "llama.cpp mmap", "llama_cpp")  # every weight left in the file's mmap
    llama_mmap.python, llama_mmap.model, llama_mmap.options = llama_python, gguf_path, {"repack": False}

    results = []
    for contender in (llama, llama_mmap, zllm):
        print(f"{contender.engine}: {args.new_tokens} tokens under a {limit_bytes / 1e9:.2f} GB limit",
              file=sys.stderr)
        results.append(run_engine(contender, args.threads, limit_bytes, prompt, args.new_tokens, args.repeats,
                                  log_dir))
    ours = results[-1]
    for result in results[:-1]:
        result["zllm_decode_vs_this"] = ours["decode_tokens_per_second"] / result["decode_tokens_per_second"]
        result["greedy_tokens_agreeing_with_zllm"] = next(
            (i for i, (a, b) in enumerate(zip(ours["tokens"], result["tokens"])) if a != b),
            min(len(ours["tokens"]), len(result["tokens"])))
    held = [r for r in results[:-1] if r["limit_held"]]
    report = {"shape": args.shape, "gguf": gguf_path, "checkpoint": checkpoint,
              "gguf_bytes": os.path.getsize(gguf_path),
              "budget": args.budget, "budget_bytes": budget_bytes, "import_rss_bytes": imported,
              "limit_bytes": limit_bytes, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
              "new_tokens": args.new_tokens, "llama_cpp_build": build.cmake_args, "engines": results,
              "decode_vs_fastest_llama_cpp_within_the_limit": (
                  ours["decode_tokens_per_second"] / max(r["decode_tokens_per_second"] for r in held)
                  if held else None)}
    print(f"random {args.shape} ({report['gguf_bytes'] / 1e9:.2f} GB GGUF), limit {limit_bytes / 1e9:.2f} GB "
          f"(budget {args.budget} = {budget_bytes / 1e9:.2f} GB + {imported / 1e6:.0f} MB interpreter), "
          f"{args.threads} threads, {args.prompt_tokens}-token prompt, {args.new_tokens} tokens")
    print(f"{'engine':<16} {'decode tok/s':>12} {'peak RSS MB':>12} {'limit held':>11} {'zllm-edge vs':>13} "
          f"{'tokens agree':>13}")
    for r in results:
        vs = r.get("zllm_decode_vs_this")
        print(f"{r['engine']:<16} {r['decode_tokens_per_second']:>12.2f} {r['peak_rss_bytes'] / 1e6:>12.0f} "
              f"{'yes' if r['limit_held'] else 'NO':>11} {'-' if vs is None else f'{vs:.2f}x':>13} "
              f"{r.get('greedy_tokens_agreeing_with_zllm', '-'):>13}")
    print("limit held NO: the engine's own memory outgrew the limit and the kernel's OOM killer took the helper "
          "holding the rest of RAM, so that engine ran with the whole machine's memory; "
          f"page cache dropped before each engine: {all(r['page_cache_dropped'] for r in results)}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(5, 3.5))
        axis.bar([r["engine"] for r in results], [r["decode_tokens_per_second"] for r in results])
        axis.set_ylabel("decode tokens/s")
        axis.set_title(f"random {args.shape}, {limit_bytes / 1e9:.1f} GB limit, {args.threads} threads")
        figure.tight_layout()
        figure.savefig(args.plot)
    publish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
