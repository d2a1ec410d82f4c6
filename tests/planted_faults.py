"""A test-only plugin that plants a fault `gyrfalcon check` must find without being told:
prompt logprobs (and so echo logprobs) reported one position late — each prompt position gets the
top tokens of the distribution that predicted the next one, llama-cpp-python's off-by-one.

Installed into a live server only (through an entry point the test writes, with the built-in
logprobs plugin blocked, whose other gatherers this one re-offers unchanged).
"""

from __future__ import annotations

from gyrfalcon.hookspecs import hookimpl
from gyrfalcon.policies.logprobs import PromptLogprobsGatherer, TokenIdsLogprobGatherer, TopLogprobsGatherer, top_k_gathered


class ShiftedPromptLogprobs(PromptLogprobsGatherer):
    def gather(self, logprobs, sampled, rows, selected):
        import torch

        shifted = torch.roll(logprobs, shifts=-1, dims=0)
        return top_k_gathered(shifted, selected, [rows.params[i].prompt_logprobs or 0 for i in selected])


@hookimpl
def gyrfalcon_logprob_gatherers(info):
    return [TopLogprobsGatherer(), TokenIdsLogprobGatherer(), ShiftedPromptLogprobs()]
