"""The pieces of `bench/step.py`, the whole-training-step benchmark: the synthetic packed-document source every
implementation reads (`source`), the measurements (`measure`: host-sync counter, compile counter; `kernels`: the
kernel-name classifier and the profiler breakdown), the implementations (`impls`: moela's own trainer step,
Hugging Face transformers; `titan`: torchtitan's DeepSeek-V3 model), the child process that runs one row (`row`)
and the Markdown / JSON output (`report`)."""
