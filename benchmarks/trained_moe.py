"""A small Mixture-of-Experts language model trained here, so that streaming meets routing that was learned.

    python benchmarks/trained_moe.py [--steps 900] [--budgets 25%,50%,75%] [--threads 1] [--storage nvme]
                                     [--json FILE] [--plot FILE.png]

No trained MoE can be downloaded here, and the default MoE (MoEfied SmolLM2) keeps 13 of its 16 experts
active, unlike any real MoE. So:

1. On first use it trains one (cached under ZLLM_EDGE_HOME/models, the recipe in the folder's name): a
   transformers Qwen3-MoE (TrainedMoeRecipe: 6 layers, hidden 256, 32 experts of 256, top-4, router
   normalized over the top-k) with the router's load-balancing loss, on Python's own documentation
   (pydoc_data.topics, less the topics the benchmark's prompts are cut from, and the docstrings of the
   standard library's modules), seeded, with a byte-level BPE tokenizer trained on the same text. It is
   saved with save_pretrained and converted as a user converts any Hugging Face folder
   (`zllm-edge convert SRC OUT --experts int4`). The loss curve and the held-out loss are kept beside it.
2. Routing statistics of greedy decoding (all experts resident) of three MoEs: the trained one, the
   default MoE and the random stress MoE (`--random-moe`): the share of a token's experts that the
   previous token also used in the same layer (beside top_k / experts, what independent routes give),
   how skewed the experts' load is, and the predictor's recall per layer distance (from a predictive run
   at 50%).
3. `zllm-edge bench`'s budget sweep on the trained MoE: the resident run, the predictive strategy at
   every --budgets, each with its bound and the fraction of it reached.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass

import numpy as np

from moe_read_floor import record_routes
from report import publish

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from edge.bench_moe import WORKLOAD_TOPICS, aligned_rows, format_moe_table, parse_budgets, run_moe_bench  # noqa: E402
from edge.core.errors import ZllmError  # noqa: E402
from edge.core.files import built_once, write_output  # noqa: E402
from edge.home import default_moe_checkpoint, first_use, home_dir, is_checkpoint  # noqa: E402
from edge.random_moe import SHAPES, random_moe_checkpoint  # noqa: E402

END_OF_TEXT = "<|endoftext|>"
# standard-library folders whose docstrings are not documentation of the language and its library
SKIPPED_STDLIB = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip",
                  "pydoc_data", "__pycache__"}


@dataclass(frozen=True)
class TrainedMoeRecipe:
    layers: int = 6
    hidden: int = 256
    experts: int = 32
    expert_intermediate: int = 256
    top_k: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 4096
    context: int = 256  # tokens per training sequence (and the checkpoint's context)
    batch: int = 16
    steps: int = 900
    learning_rate: float = 2e-3
    warmup_steps: int = 50
    router_aux_loss: float = 0.01  # the load-balancing loss's weight (Switch Transformer's)
    seed: int = 0

    @property
    def name(self) -> str:
        return (f"trained-moe-{self.layers}x{self.experts}e-top{self.top_k}-h{self.hidden}-i{self.expert_intermediate}"
                f"-v{self.vocab}-c{self.context}-b{self.batch}-s{self.steps}-seed{self.seed}")

    def learning_rate_at(self, step: int) -> float:
        """Linear warm-up, then a cosine decay to a tenth."""
        if step < self.warmup_steps:
            return self.learning_rate * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


# ---------------------------------------------------------------------------------- the text


def documentation(held_out: tuple[str, ...] = WORKLOAD_TOPICS) -> tuple[list[str], list[str]]:
    """Python's own documentation as (training documents, held-out documents): pydoc_data.topics (the
    held-out topics apart) and the docstrings of the standard library's modules, classes and functions,
    in a fixed order."""
    from pydoc_data.topics import topics

    train = [topics[name] for name in sorted(topics) if name not in held_out]
    held = [topics[name] for name in held_out]
    stdlib = sysconfig.get_paths()["stdlib"]
    for root, folders, files in os.walk(stdlib):
        folders[:] = sorted(f for f in folders if f not in SKIPPED_STDLIB)
        for file in sorted(f for f in files if f.endswith(".py")):
            try:
                with open(os.path.join(root, file), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    text = ast.get_docstring(node)
                    if text and len(text) > 40:
                        train.append(text)
    return train, held


def train_tokenizer(documents: list[str], vocab: int):
    """A byte-level BPE tokenizer of `vocab` tokens (the first one END_OF_TEXT) trained on the documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def token_stream(tokenizer, documents: list[str]) -> np.ndarray:
    """The documents' ids, each followed by END_OF_TEXT, as one array."""
    end = tokenizer.token_to_id(END_OF_TEXT)
    ids = []
    for encoding in tokenizer.encode_batch(documents):
        ids.extend(encoding.ids)
        ids.append(end)
    return np.asarray(ids, dtype=np.int64)


# ---------------------------------------------------------------------------------- training


def qwen3_moe_config(recipe: TrainedMoeRecipe, end_id: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=recipe.vocab, hidden_size=recipe.hidden, intermediate_size=4 * recipe.hidden,
                          moe_intermediate_size=recipe.expert_intermediate, num_hidden_layers=recipe.layers,
                          num_attention_heads=recipe.heads, num_key_value_heads=recipe.kv_heads,
                          head_dim=recipe.head_dim, num_experts=recipe.experts, num_experts_per_tok=recipe.top_k,
                          norm_topk_prob=True, router_aux_loss_coef=recipe.router_aux_loss,
                          output_router_logits=True, max_position_embeddings=recipe.context,
                          tie_word_embeddings=False, bos_token_id=end_id, eos_token_id=end_id, pad_token_id=end_id)


def train(recipe: TrainedMoeRecipe, folder: str, threads: int | None = None) -> dict:
    """Train the recipe's model and save it (weights, tokenizer, training.json) into `folder`; returns
    the training log."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3MoeForCausalLM

    torch.manual_seed(recipe.seed)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    started = time.perf_counter()
    documents, held_out = documentation()
    tokenizer = train_tokenizer(documents, recipe.vocab)
    stream, held_stream = token_stream(tokenizer, documents), token_stream(tokenizer, held_out)
    end_id = tokenizer.token_to_id(END_OF_TEXT)
    print(f"[train] {len(documents)} documents, {len(stream)} training tokens, {len(held_stream)} held out; "
          f"tokenizer of {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - started:.0f} s",
          file=sys.stderr, flush=True)
    model = Qwen3MoeForCausalLM(qwen3_moe_config(recipe, end_id))
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(recipe.seed)

    def windows(ids: np.ndarray, starts: np.ndarray) -> "torch.Tensor":
        return torch.from_numpy(np.stack([ids[s:s + recipe.context] for s in starts]))

    log, began = [], time.perf_counter()
    model.train()
    for step in range(recipe.steps):
        for group in optimizer.param_groups:
            group["lr"] = recipe.learning_rate_at(step)
        batch = windows(stream, rng.integers(0, len(stream) - recipe.context, recipe.batch))
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # out.loss includes the weighted load-balancing loss; the language-model loss is the rest
        aux = float(out.aux_loss.detach())
        log.append({"step": step, "loss": float(out.loss.detach()) - recipe.router_aux_loss * aux, "aux_loss": aux})
        if step % 10 == 0 or step == recipe.steps - 1:
            elapsed = time.perf_counter() - began
            rate = (step + 1) * recipe.batch * recipe.context / elapsed
            left = elapsed / (step + 1) * (recipe.steps - step - 1)
            print(f"[train] step {step + 1}/{recipe.steps}: loss {log[-1]['loss']:.3f}, load-balancing {aux:.3f}, "
                  f"{rate:.0f} tokens/s, {left / 60:.1f} min left", file=sys.stderr, flush=True)
    model.eval()
    held_losses = []
    with torch.no_grad():  # the held-out topics, in whole windows
        starts = np.arange(0, len(held_stream) - recipe.context, recipe.context)
        for i in range(0, len(starts), recipe.batch):
            batch = windows(held_stream, starts[i:i + recipe.batch])
            out = model(input_ids=batch, labels=batch)
            held_losses.append(float(out.loss) - recipe.router_aux_loss * float(out.aux_loss))
    model.config.output_router_logits = False  # (inference needs no router logits)
    model.save_pretrained(folder)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=END_OF_TEXT, eos_token=END_OF_TEXT,
                                      pad_token=END_OF_TEXT, model_max_length=recipe.context)
    wrapped.save_pretrained(folder)
    training = {"recipe": asdict(recipe), "documents": len(documents), "training_tokens": int(len(stream)),
                "held_out_topics": list(WORKLOAD_TOPICS), "held_out_tokens": int(len(held_stream)),
                "tokens_seen": recipe.steps * recipe.batch * recipe.context,
                "epochs": recipe.steps * recipe.batch * recipe.context / len(stream),
                "threads": torch.get_num_threads(), "seconds": time.perf_counter() - started,
                "final_loss": float(np.mean([entry["loss"] for entry in log[-20:]])),
                "held_out_loss": float(np.mean(held_losses)), "torch": torch.__version__, "log": log}
    with open(os.path.join(folder, "training.json"), "w") as f:
        json.dump(training, f, indent=1)
    return training


def trained_moe_checkpoint(home: str, recipe: TrainedMoeRecipe = TrainedMoeRecipe(), threads: int | None = None,
                           progress: bool = True) -> str:
    """The recipe's checkpoint under `home`/models, trained and converted on first use. The Hugging Face
    folder stays beside it (`.hf`), so a second conversion does not train again."""
    from converters.convert import QuantPlan, convert

    path = os.path.join(home, "models", recipe.name)
    source = path + ".hf"

    def trained() -> bool:
        return os.path.isfile(os.path.join(source, "training.json"))

    def build() -> None:
        print(f"building the trained MoE {recipe.name} into {path} ({first_use(path)})", file=sys.stderr)
        if not trained():
            staging = source + ".partial"
            shutil.rmtree(staging, ignore_errors=True)
            train(recipe, staging, threads)
            shutil.rmtree(source, ignore_errors=True)
            os.rename(staging, source)
        # what `zllm-edge convert SOURCE PATH --experts int4` does
        summary = convert(source, path, QuantPlan(weights="int8", overrides={"experts": "int4"}), force=True,
                          progress=progress)
        print(summary.format(), file=sys.stderr)

    return built_once(path, is_checkpoint, build, "building the trained MoE")


# ---------------------------------------------------------------------------------- routing


def routing_statistics(steps: list[dict[int, list[int]]], experts: int, top_k: int) -> dict:
    """Of greedy decode steps' routes (per step: MoE layer -> the distinct experts it used):
    reuse: the share of a step's experts that the step before also used in that layer;
    chance: what independent uniform routes give (top_k / experts);
    load: per layer, each expert's share of the uses over its mean share, max and the normalized entropy
    (1.0: every expert used equally; 0: one expert only)."""
    layers = sorted(steps[0])
    reuse = {layer: [] for layer in layers}
    for before, now in zip(steps, steps[1:]):
        for layer in layers:
            reuse[layer].append(len(set(before[layer]) & set(now[layer])) / len(now[layer]))
    load_max, entropy = {}, {}
    for layer in layers:
        counts = np.bincount(np.concatenate([step[layer] for step in steps]).astype(np.int64), minlength=experts)
        share = counts / counts.sum()
        load_max[layer] = float(share.max() * experts)
        used = share[share > 0]
        entropy[layer] = float(-(used * np.log(used)).sum() / np.log(experts))
    return {"steps": len(steps), "layers": len(layers), "experts": experts, "top_k": top_k,
            "reuse_share": float(np.mean([np.mean(v) for v in reuse.values()])) if len(steps) > 1 else None,
            "reuse_share_by_layer": {layer: float(np.mean(v)) for layer, v in reuse.items() if v},
            "chance_reuse_share": top_k / experts,
            "max_load_over_mean": float(np.mean(list(load_max.values()))),
            "max_load_over_mean_by_layer": load_max,
            "load_entropy": float(np.mean(list(entropy.values()))), "load_entropy_by_layer": entropy}


def moe_shape(path: str) -> tuple[int, int]:
    """(experts per MoE layer, experts per token) of a checkpoint."""
    from edge.core.spec import spec_from_dict
    from quant.checkpoint import read_manifest

    spec = spec_from_dict(read_manifest(path)["model"])
    moe = next(config for config in map(spec.moe_for_layer, range(spec.num_hidden_layers)) if config is not None)
    return moe.num_experts, moe.top_k


def format_routing_table(routing: dict) -> str:
    distances = sorted({d for entry in routing.values() for d in entry["predictor_recall_by_distance"]})
    header = ["model", "experts", "top-k", "reuse", "chance", "max load/mean", "load entropy",
              *[f"recall d{d}" for d in distances]]
    rows = [header]
    for name, entry in routing.items():
        recall = entry["predictor_recall_by_distance"]
        rows.append([name, str(entry["experts"]), str(entry["top_k"]), f"{entry['reuse_share']:.3f}",
                     f"{entry['chance_reuse_share']:.3f}", f"{entry['max_load_over_mean']:.2f}",
                     f"{entry['load_entropy']:.3f}",
                     *[("-" if recall.get(d) is None else f"{recall[d]:.3f}") for d in distances]])
    lines = ["routing of greedy decode, all experts resident (reuse: share of a token's experts the previous "
             "token also used in that layer; chance: top-k / experts; recall dN: the predictor's recall N "
             "layers ahead, predictive at 50%)"]
    return "\n".join(lines + aligned_rows(rows, left=1))


def plot(result: dict, path: str) -> None:
    """Left: reuse and recall per layer distance of each model; right: the trained MoE's budget sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (routes, sweep) = plt.subplots(1, 2, figsize=(12, 4.4))
    routing = result["routing"]
    distances = sorted({d for entry in routing.values() for d in entry["predictor_recall_by_distance"]})
    labels = ["reuse", "chance", *[f"recall d{d}" for d in distances]]
    width = 0.8 / len(routing)
    for i, (name, entry) in enumerate(routing.items()):
        values = [entry["reuse_share"], entry["chance_reuse_share"],
                  *[entry["predictor_recall_by_distance"].get(d) or 0 for d in distances]]
        routes.bar(np.arange(len(labels)) + i * width, values, width, label=name)
    routes.set_xticks(np.arange(len(labels)) + width * (len(routing) - 1) / 2, labels)
    routes.set(ylabel="share", ylim=(0, 1.05), title="routing of greedy decode")
    routes.legend()
    report = result["sweeps"]["trained"]
    rows = [r for r in report["configs"] if "error" not in r]
    resident = next((r for r in rows if r["strategy"] == "resident"), None)
    streamed = sorted((r for r in rows if r["strategy"] != "resident"), key=lambda r: r["expert_share"] or 0)
    shares = [100 * (r["expert_share"] or 0) for r in streamed]
    sweep.plot(shares, [r["decode_tokens_per_second"] for r in streamed], marker="o", label="predictive")
    sweep.plot(shares, [(r.get("bound") or {}).get("tokens_per_second") for r in streamed], marker="x",
               linestyle=":", label="bound")
    if resident:
        sweep.axhline(resident["decode_tokens_per_second"], linestyle="--", color="gray", label="resident")
    sweep.set(xlabel="expert cache (% of all expert bytes)", ylabel="decode tokens/s", ylim=(0, None),
              title=f"trained MoE, storage {report['storage']}, {report['threads']} thread(s)")
    sweep.legend()
    for axis in (routes, sweep):
        axis.grid(alpha=0.3)
    figure.tight_layout()
    try:
        write_output(path, lambda f: figure.savefig(f, format="png", dpi=120), binary=True)
    finally:
        plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=TrainedMoeRecipe.steps, help="training steps (first use)")
    parser.add_argument("--train-threads", type=int, default=None, help="torch threads for training (all cores)")
    parser.add_argument("--budgets", default="25%,50%,75%", help="the trained MoE's sweep")
    parser.add_argument("--threads", type=int, default=1, help="compute threads of the decode runs")
    parser.add_argument("--storage", default="nvme", help="the storage the streamed runs emulate")
    parser.add_argument("--route-tokens", type=int, default=160, help="decode steps the routing statistics see")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="a PNG of the routing statistics and the sweep")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    try:  # (checked before minutes of training)
        sweep_budgets = parse_budgets(args.budgets)
    except ZllmError as exc:
        parser.error(str(exc))
    recipe = TrainedMoeRecipe(steps=args.steps)
    home = home_dir()
    models = {"trained": trained_moe_checkpoint(home, recipe, args.train_threads),
              "moefied-smollm2": default_moe_checkpoint(),
              "random-stress": random_moe_checkpoint(home, SHAPES["stress"])}
    with open(os.path.join(models["trained"] + ".hf", "training.json")) as f:
        training = {key: value for key, value in json.load(f).items() if key != "log"}

    def progress(message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    routing, sweeps = {}, {}
    for name, path in models.items():
        budgets = sweep_budgets if name == "trained" else ["50%"]
        progress(f"{name}: budgets {', '.join(budgets)}")
        sweeps[name] = run_moe_bench(path, budgets, ["resident", "predictive"], args.storage, threads=args.threads,
                                     prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                     repeats=args.repeats, progress=progress)
        progress(f"{name}: the routes of {args.route_tokens} decode steps")
        experts, top_k = moe_shape(path)
        routing[name] = routing_statistics(record_routes(path, args.route_tokens), experts, top_k)
        half = next((r for r in sweeps[name]["configs"]
                     if r["strategy"] == "predictive" and r["budget"] == "50%" and "error" not in r), None)
        routing[name]["predictor_recall_by_distance"] = {} if half is None else half["predictor_recall_by_distance"]
    print(f"trained MoE {recipe.name}: {training['tokens_seen']} tokens seen ({training['epochs']:.1f} epochs) in "
          f"{training['seconds'] / 60:.1f} min on {training['threads']} thread(s); loss {training['final_loss']:.3f}, "
          f"held out {training['held_out_loss']:.3f}")
    print(format_routing_table(routing))
    print(format_moe_table(sweeps["trained"]))
    result = {"recipe": asdict(recipe), "models": models, "training": training, "routing": routing, "sweeps": sweeps}
    if args.plot:
        plot(result, args.plot)
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
