"""One engine in its own process, driven by benchmarks/peers.py over JSON lines.

    python peer_worker.py '{"engine": "llama_cpp", "model": "x.gguf", "threads": 2, "context": 272}'

runs in whichever interpreter the engine needs (the project's, or a venv's from bench_envs.py), so
it imports nothing at module level beyond the standard library and numpy. After loading it writes
{"event": "loaded", ...}; then each command line on stdin gets one answer line on stdout:

    {"cmd": "run", "prompt_ids": [...], "new_tokens": N}  ->  {"event": "ran", timings, tokens}
    {"cmd": "stop"}                                        ->  {"event": "stopped", "peak_rss_bytes": ...}

Every engine runs the same greedy loop: prefill the prompt ids (timed), argmax, then N - 1 decode
steps of one token each (only the engine's forward calls timed). The ids are the caller's, so
every engine sees exactly the same tokens. Anything the engines print goes to stderr: stdout
carries only the protocol.

Also: `python peer_worker.py --quantize SRC DST FTYPE [pure|mix]` requantizes a GGUF with llama.cpp.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def peak_rss_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class Engine:
    """load in __init__; prefill(ids) -> last logits; decode(token) -> logits; weight_bytes_per_token."""

    info: dict
    weight_bytes_per_token: int | None

    def reset(self) -> None: ...

    def prefill(self, ids: list[int]): ...

    def decode(self, token: int): ...

    def greedy(self, prompt_ids: list[int], new_tokens: int) -> dict:
        self.reset()
        started = time.perf_counter()
        logits = self.prefill(prompt_ids)
        prefill_seconds = time.perf_counter() - started
        token = int(np.argmax(logits))
        first_token_seconds = time.perf_counter() - started
        tokens, decode_seconds = [token], 0.0
        for _ in range(new_tokens - 1):
            step = time.perf_counter()
            logits = self.decode(token)
            decode_seconds += time.perf_counter() - step
            token = int(np.argmax(logits))
            tokens.append(token)
        return {"prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds,
                "time_to_first_token_seconds": first_token_seconds, "decode_steps": new_tokens - 1, "tokens": tokens}


class ZllmEngine(Engine):
    def __init__(self, model: str, threads: int, context: int, device: str = "reference",
                 load_options: dict | None = None):
        import edge
        from edge.bench import load_threads  # reference and gpu take no count; the pools are capped instead

        # load_options: further edge.load settings (a MoE benchmark's memory budget and expert strategy)
        self.model = edge.load(model, device=device, threads=load_threads(device, threads), **(load_options or {}))
        self.info = {"device_info": self.model.device_info()}
        # tied embeddings: the LM head reads the whole table each token, so every stored byte counts
        self.weight_bytes_per_token = self.model.weight_bytes

    def greedy(self, prompt_ids, new_tokens):
        from edge.bench import greedy_run  # the very loop `zllm-edge bench` times

        run = greedy_run(self.model, prompt_ids, new_tokens)
        return {"prefill_seconds": run.prefill_seconds, "decode_seconds": run.decode_seconds,
                "time_to_first_token_seconds": run.time_to_first_token_seconds, "decode_steps": run.decode_steps,
                "tokens": run.tokens}


class LlamaCppEngine(Engine):
    def __init__(self, model: str, threads: int, context: int, repack: bool = True):
        """`repack` False: no extra buffer types, so that llama.cpp leaves every weight in its mmap of the
        file instead of repacking Q4_0 (and others) into interleaved copies in anonymous memory."""
        import llama_cpp
        import llama_cpp.llama_cpp as bindings

        if not repack:
            default_params = bindings.llama_model_default_params

            def without_extra_buffer_types():
                params = default_params()
                params.use_extra_bufts = False
                return params

            bindings.llama_model_default_params = without_extra_buffer_types
        self.llama_cpp = llama_cpp
        self.llm = llama_cpp.Llama(model_path=model, n_ctx=context, n_batch=512, n_ubatch=512, n_threads=threads,
                                   n_threads_batch=threads, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.info = {"llama_cpp_python": llama_cpp.__version__,
                     "system_info": llama_cpp.llama_print_system_info().decode().strip()}
        self.weight_bytes_per_token = None  # peers.py reads the GGUF's tensor sizes with the gguf package

    def _last_logits(self):
        pointer = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    def reset(self) -> None:
        self.llm.reset()  # eval() then drops the KV cells beyond n_tokens = 0

    def prefill(self, ids):
        self.llm.eval(ids)
        return self._last_logits()

    def decode(self, token):
        self.llm.eval([token])
        return self._last_logits()


class TransformersEngine(Engine):
    def __init__(self, model: str, threads: int, context: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.info = {"torch": torch.__version__, "attention": self.model.config._attn_implementation}
        # parameters() yields a tied lm_head/embedding once; the head reads it all every token
        self.weight_bytes_per_token = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.cache = None

    def reset(self) -> None:
        self.cache = None

    def _forward(self, ids):
        with self.torch.inference_mode():
            out = self.model(self.torch.tensor([ids]), past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0, -1].numpy()

    def prefill(self, ids):
        return self._forward(ids)

    def decode(self, token):
        return self._forward([token])


class OrtGenaiEngine(Engine):
    """onnxruntime-genai. Its generate_next_token() samples from the logits it holds and then, from
    the second call on, runs the model on the token it sampled: so the first call after
    append_tokens is the first token (no forward pass) and every later call is one decode step."""

    def __init__(self, model: str, threads: int, context: int):
        import onnxruntime_genai as og

        self.og = og
        folder = self._with_threads(model, threads)
        self.model = og.Model(folder)
        self.context = context
        self.info = {"onnxruntime_genai": og.__version__}
        self.weight_bytes_per_token = onnx_weight_bytes_per_token(os.path.join(model, "model.onnx"))
        self.generator = None

    @staticmethod
    def _with_threads(model: str, threads: int) -> str:
        """A folder beside the model whose genai_config pins ORT's thread pools; the rest are links."""
        folder = f"{model.rstrip(os.sep)}.threads-{threads}"
        os.makedirs(folder, exist_ok=True)
        for name in os.listdir(model):
            link = os.path.join(folder, name)
            if name != "genai_config.json" and not os.path.lexists(link):
                os.symlink(os.path.join(os.path.abspath(model), name), link)
        with open(os.path.join(model, "genai_config.json")) as f:
            config = json.load(f)
        config["model"]["decoder"]["session_options"].update(intra_op_num_threads=threads, inter_op_num_threads=1)
        with open(os.path.join(folder, "genai_config.json"), "w") as f:
            json.dump(config, f, indent=1)
        return folder

    def greedy(self, prompt_ids, new_tokens):
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt_ids) + new_tokens, do_sample=False)
        generator = self.og.Generator(self.model, params)
        started = time.perf_counter()
        generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
        prefill_seconds = time.perf_counter() - started
        generator.generate_next_token()  # greedy choice from the prefill's logits
        first_token_seconds = time.perf_counter() - started
        decode_seconds = 0.0
        for _ in range(new_tokens - 1):
            step = time.perf_counter()
            generator.generate_next_token()  # forward of the previous token, then its argmax
            decode_seconds += time.perf_counter() - step
        tokens = [int(t) for t in generator.get_sequence(0)[len(prompt_ids):]]
        return {"prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds,
                "time_to_first_token_seconds": first_token_seconds, "decode_steps": new_tokens - 1, "tokens": tokens}


def onnx_weight_bytes_per_token(path: str) -> int:
    """Bytes of the graph's initializers, less embedding tables (a Gather reads one row per token)."""
    import onnx

    graph = onnx.load(path, load_external_data=False).graph
    consumers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, set()).add(node.op_type)
    total = 0
    for tensor in graph.initializer:
        if consumers.get(tensor.name) and consumers[tensor.name] <= {"Gather", "GatherBlockQuantized"}:
            continue  # read one row per token; a table the LM head also multiplies by is counted whole
        external = {entry.key: entry.value for entry in tensor.external_data}
        if "length" in external:
            total += int(external["length"])
        else:
            total += len(tensor.raw_data) if tensor.raw_data else onnx.numpy_helper.to_array(tensor).nbytes
    return total


ENGINES = {"zllm": ZllmEngine, "llama_cpp": LlamaCppEngine, "transformers": TransformersEngine,
           "ort_genai": OrtGenaiEngine}


def quantize_gguf(source: str, destination: str, ftype_name: str, mix: str = "pure") -> None:
    """Requantize a GGUF with llama.cpp: every tensor to one type (pure, like `llama-quantize --pure`), or
    (mix) with the type's own choice per tensor, as `llama-quantize` does by default."""
    if mix not in ("pure", "mix"):
        raise ValueError(f"the tensor mix is 'pure' or 'mix', got {mix!r}")
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True  # the source is already Q4_1/Q8_0
    params.pure = mix == "pure"
    params.nthread = os.cpu_count() or 1
    status = llama_cpp.llama_model_quantize(source.encode(), destination.encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {ftype_name}) returned {status}")


def serve(spec: dict) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the engines print goes to stderr

    def send(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    try:
        started = time.perf_counter()
        engine = ENGINES[spec["engine"]](spec["model"], spec["threads"], spec["context"], **spec.get("options", {}))
        send({"event": "loaded", "load_seconds": time.perf_counter() - started, "info": engine.info,
              "weight_bytes_per_token": engine.weight_bytes_per_token})
        for line in sys.stdin:
            command = json.loads(line)
            if command["cmd"] == "stop":
                send({"event": "stopped", "peak_rss_bytes": peak_rss_bytes()})
                return
            send({"event": "ran", **engine.greedy(command["prompt_ids"], command["new_tokens"])})
    except Exception as exc:  # reported to peers.py, which prints it as the reason this engine is missing
        send({"event": "error", "message": f"{type(exc).__name__}: {exc}"})
        raise


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if sys.argv[1] == "--quantize":
        quantize_gguf(*sys.argv[2:6])
    else:
        serve(json.loads(sys.argv[1]))
