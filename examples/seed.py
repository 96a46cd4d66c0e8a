"""The seed's example, as written: one kernel, adapters from the hub, a chain, a mixed batch.

    LORALAND_ADAPTER_PATH=/adapters python examples/seed.py MODEL_DIR
(/adapters holds org/translate/ and org/polish/ PEFT folders.)
"""

import sys

from loraland import AdapterHub, LLMKernel

kernel = LLMKernel(model_id=sys.argv[1], max_adapters=512, max_batch_size=32, gpu_memory_utilization=0.92)
hub = AdapterHub()
kernel.load_adapter("translate", hub.get("org/translate"))
kernel.load_adapter("polish", hub.get("org/polish"))
kernel.set_adaptive_chain(["translate", "polish"])  # translate, then polish

prompts = ["the quick brown fox", "hello world", "ray serve adapters"]
print("chain:", kernel.infer(prompts, adapter_ids=[None, None, None], max_tokens=8))
print(
    "mixed:",
    kernel.infer(prompts, adapter_ids=["translate", "polish", "translate*0.5+polish*0.5"], max_tokens=8),
)
kernel.close()
