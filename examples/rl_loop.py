"""A toy RL loop against a gyrfalcon rollout server, on the CPU, in plain torch.

Each step, the trainer asks the server for ``n`` = 8 rollouts of each of its prompts through
``POST /inference/v1/generate`` (each sampled token with its logprob), checks those logprobs
against its own forward over the same tokens, scores the rollouts with a toy reward (the share of
tokens from a chosen half of the vocabulary), takes one REINFORCE step, writes the new weights and
pushes them to the server between a pause and a resume (``POST /pause?mode=wait``,
``POST /update_weights_from_disk`` with the step as the weight version, ``POST /resume``). It prints
each step's mean reward (it goes up), the largest gap between the server's and its own logprobs,
and the weight version the rollouts say made them.

    python examples/rl_loop.py                    # builds a tiny model and serves it itself
    python examples/rl_loop.py --url URL --model DIR   # a server started with --enable-rl-endpoints on DIR

The server must serve the trainer's weights exactly (``--quantization none --dtype float32``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import requests
import torch

PROMPTS = [[5, 6, 7], [40, 41, 42, 43], [90, 91], [200, 201, 202, 203, 204]]
N, NEW_TOKENS = 8, 8


def reward(tokens: list[int], vocab: int) -> float:
    """The toy reward: the share of tokens from the upper half of the vocabulary."""
    return sum(t >= vocab // 2 for t in tokens) / len(tokens)


def rollouts(url: str, step: int) -> list[tuple[list[int], list[int], list[float], list[dict]]]:
    """Every prompt's ``N`` rollouts: (prompt, tokens, the server's logprobs, weight versions)."""
    out = []
    for i, prompt in enumerate(PROMPTS):
        body = {"token_ids": prompt, "sampling_params": {"n": N, "temperature": 1.0, "max_tokens": NEW_TOKENS,
                                                        "ignore_eos": True, "logprobs": 0, "seed": 1000 * step + i}}
        answer = requests.post(f"{url}/inference/v1/generate", json=body, timeout=120)
        answer.raise_for_status()
        for choice in answer.json()["choices"]:
            logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
            out.append((prompt, choice["token_ids"], logprobs, choice.get("weight_versions") or []))
    return out


def own_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The trainer's logprob of each rollout token: one forward over prompt + rollout."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def push(url: str, folder: str, version: str) -> None:
    """The new weights to the server between a pause and a resume."""
    requests.post(f"{url}/pause", params={"mode": "wait"}, timeout=120).raise_for_status()
    try:
        answer = requests.post(f"{url}/update_weights_from_disk", json={"model_path": folder, "weight_version": version},
                               timeout=600)
        answer.raise_for_status()
    finally:
        requests.post(f"{url}/resume", timeout=120).raise_for_status()


def train(url: str, model_dir: str, steps: int, lr: float, work: str) -> float:
    """``steps`` steps of the loop; the largest logprob gap seen."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    widest = 0.0
    for step in range(steps):
        batch = rollouts(url, step)
        rewards = torch.tensor([reward(tokens, vocab) for _, tokens, _, _ in batch])
        advantages = rewards - rewards.mean()
        loss, gap = torch.zeros(()), 0.0
        for (prompt, tokens, served, _), advantage in zip(batch, advantages):
            mine = own_logprobs(model, prompt, tokens)
            gap = max(gap, float((mine.detach() - torch.tensor(served)).abs().max()))
            loss = loss - advantage * mine.sum() / len(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        widest = max(widest, gap)
        versions = sorted({span["version"] for *_, spans in batch for span in spans})
        folder = os.path.join(work, f"step-{step + 1}")
        model.save_pretrained(folder)
        push(url, folder, f"step-{step + 1}")
        print(f"step {step + 1}: mean reward {float(rewards.mean()):.3f}, largest logprob gap {gap:.2e}, "
              f"rollouts made by {', '.join(versions) or '?'}", flush=True)
    return widest


def _serve(model_dir: str, log: str) -> tuple[str, subprocess.Popen]:
    """``gyrfalcon serve`` on ``model_dir`` with the control routes, once it answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "gyrfalcon.cli", "serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
         "--enable-rl-endpoints", "--quantization", "none", "--dtype", "float32", "--enforce-eager", "--max-model-len", "64"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return url, process
        except requests.RequestException:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not start; its log: {log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--url", help="a server started with --enable-rl-endpoints (default: start one on a tiny model)")
    p.add_argument("--model", help="the folder that server serves (with --url)")
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="gyrfalcon-rl-")
    process = None
    if args.url is None:
        from gyrfalcon.models.tiny import build_tiny_model

        args.model = str(build_tiny_model(os.path.join(work, "step-0")))
        args.url, process = _serve(args.model, os.path.join(work, "server.log"))
    try:
        gap = train(args.url.rstrip("/"), args.model, args.steps, args.lr, work)
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)
    print(f"largest logprob gap over {args.steps} steps: {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
