"""LoRA adapters served beside the base model (``--enable-lora``): a PEFT folder read and checked
against the served layers (:mod:`.peft`), the adapters held by name in a bounded registry
(:mod:`.registry`), and their low-rank products added to each row's projections by the adapter its
request names (:mod:`.step`)."""
