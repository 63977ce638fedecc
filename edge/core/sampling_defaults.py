"""The sampling a checkpoint asks a conversation to use: read from a Hugging Face generation_config.json
at convert, kept in the manifest's tokenizer entry as "sampling", checked again at load."""
from __future__ import annotations

from edge.core.arguments import integer, number, shown
from edge.core.errors import InvalidArgumentError

SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
# transformers' GenerationConfig defaults, for the fields a generation_config.json that samples leaves out
TRANSFORMERS_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


def sampling_of_generation_config(config: dict) -> dict | None:
    """What a generation_config.json says a generation samples with: its own values over transformers'
    defaults when `do_sample` is true, greedy when it is false, None when it does not say (no
    `do_sample`). InvalidArgumentError names a value of the wrong type or range."""
    do_sample = config.get("do_sample")
    if do_sample is None:
        return None
    if not isinstance(do_sample, bool):
        raise InvalidArgumentError(f"do_sample is {shown(do_sample)}; expected true or false")
    if not do_sample:
        return {"temperature": 0.0}
    sampling = {name: config[name] if config.get(name) is not None else TRANSFORMERS_SAMPLING[name]
                for name in SAMPLING_FIELDS}
    return check_sampling(sampling)


def check_sampling(sampling) -> dict:
    """A checkpoint's sampling: an object of some SAMPLING_FIELDS in the sampler's ranges (as
    edge.sampling.SamplingParams checks them), as plain numbers; InvalidArgumentError otherwise."""
    if not isinstance(sampling, dict) or not set(sampling) <= set(SAMPLING_FIELDS):
        raise InvalidArgumentError(f"sampling is {shown(sampling)}; expected an object of some of "
                                   f"{', '.join(SAMPLING_FIELDS)}")
    checks = {
        "temperature": lambda v: number("temperature", v, minimum=0),
        "top_k": lambda v: integer("top_k", v, minimum=0),
        "top_p": lambda v: number("top_p", v, minimum=0, maximum=1),
        "min_p": lambda v: number("min_p", v, minimum=0, maximum=1),
        "repetition_penalty": lambda v: number("repetition_penalty", v, above=0),
    }
    return {name: checks[name](value) for name, value in sampling.items()}
