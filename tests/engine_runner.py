"""A vLLM engine (CPU, tiny Llama) in its own process, driven by a test over stdin/stdout.

Protocol, one JSON object per line:
  runner -> test: {"ready": true, "namespace": DIGEST|null, "namespaces": [DIGEST per TP rank]|null,
                   "key_prefix": STR|null}
  test -> runner: {"prompts": [[token ids]...], "max_tokens": N, "reset_prefix_cache": bool,
                   "cache_salts": [salt or null per prompt] (optional),
                   "loras": [[adapter name, adapter path] or null per prompt] (optional; needs --max-loras)}
  runner -> test: {"outputs": [{"tokens": [...], "logprobs": [...], "num_cached_tokens": N}...]}
Closing stdin ends the engine. The runner's own log goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv-transfer-config", default=None, help="JSON, as for vllm serve")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-events-config", default=None, help="JSON, as for vllm serve")
    parser.add_argument("--attention-backend", default=None, help="vLLM's attention backend, e.g. CPU_MLA")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--max-loras", type=int, default=0, help="LoRA adapters at once (rank up to 8); 0: no LoRA")
    args = parser.parse_args()

    # vLLM logs to stdout: keep the real stdout for the protocol and send
    # everything else written to fd 1 to stderr.
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.lora.request import LoRARequest

    kv_config = json.loads(args.kv_transfer_config) if args.kv_transfer_config else None
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=32,
        enforce_eager=True,
        seed=0,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=512 << 20,
        tensor_parallel_size=args.tensor_parallel_size,
        kv_transfer_config=KVTransferConfig(**kv_config) if kv_config else None,
        kv_events_config=KVEventsConfig(**json.loads(args.kv_events_config)) if args.kv_events_config else None,
        attention_config={"backend": args.attention_backend} if args.attention_backend else None,
        **({"enable_lora": True, "max_lora_rank": 8, "max_loras": args.max_loras} if args.max_loras else {}),
    )
    lora_ids: dict[str, int] = {}  # vLLM tells adapters apart by their int id: one per name
    namespace = None
    namespaces = None
    key_prefix = None
    # Another connector (vLLM's ExampleConnector as a baseline) has no DualPath namespace.
    if kv_config and kv_config["kv_connector"] == "DualPathConnector":
        from dualpath_connector.config import ChunkGeometry, namespace_for, parse_config

        vllm_config = llm.llm_engine.vllm_config
        config = parse_config(kv_config.get("kv_connector_extra_config"))
        chunk_tokens = ChunkGeometry.of(config, vllm_config).chunk_tokens
        # Each TP rank stores its shard under its own namespace; chunk hashes chain from rank 0's (the engine's).
        namespaces = [namespace_for(vllm_config, config, chunk_tokens, tp_rank=rank, pp_rank=0).digest()
                      for rank in range(args.tensor_parallel_size)]  # fmt: skip
        namespace = namespaces[0]
        key_prefix = config.key_prefix
    ready = {"ready": True, "namespace": namespace, "namespaces": namespaces, "key_prefix": key_prefix}
    print(json.dumps(ready), file=protocol)

    for line in sys.stdin:
        command = json.loads(line)
        if command.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=command["max_tokens"], logprobs=0, ignore_eos=True)
        salts = command.get("cache_salts") or [None] * len(command["prompts"])
        prompts = [{"prompt_token_ids": p, **({"cache_salt": s} if s else {})} for p, s in zip(command["prompts"], salts)]
        loras = [LoRARequest(a[0], lora_ids.setdefault(a[0], len(lora_ids) + 1), a[1]) if a else None
                 for a in command.get("loras") or [None] * len(prompts)]  # fmt: skip
        results = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        outputs = []
        for result in results:
            completion = result.outputs[0]
            outputs.append(
                {
                    "tokens": list(completion.token_ids),
                    "logprobs": [lp[tok].logprob for tok, lp in zip(completion.token_ids, completion.logprobs)],
                    "num_cached_tokens": result.num_cached_tokens,
                }
            )
        print(json.dumps({"outputs": outputs}), file=protocol)


if __name__ == "__main__":
    main()
