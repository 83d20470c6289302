"""Train-step time of the ``tusimple`` preset: laneflow's message passing vs a plain per-slice loop.

The baseline is the same architecture and weights with message passing written the textbook way:
slice every row/column, convolve, add, and concatenate the Python list. Target >= 1.0x (never slower).

    .venv/bin/python bench/train_step.py [--batch-size 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

from training.model import SCNN, MessagePassing, SCNNLoss, model_config


class LoopMessagePassing(nn.Module):
    """Per-slice message passing with a Python list and torch.cat (the common implementation)."""

    def __init__(self, original: MessagePassing):
        super().__init__()
        self.direction = original.direction
        self.weight = original.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vertical = self.direction in ("down", "up")
        dim = 2 if vertical else 3
        slices = [x.narrow(dim, i, 1) for i in range(x.shape[dim])]
        if self.direction in ("up", "left"):
            slices = slices[::-1]
        padding = (0, self.weight.shape[3] // 2) if vertical else (self.weight.shape[2] // 2, 0)
        out = [slices[0]]
        for current in slices[1:]:
            out.append(current + F.relu(F.conv2d(out[-1], self.weight, padding=padding)))
        if self.direction in ("up", "left"):
            out = out[::-1]
        return torch.cat(out, dim=dim)


def step_seconds(model: nn.Module, batch: tuple[torch.Tensor, ...], steps: int) -> float:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = SCNNLoss()
    images, masks, exist = batch
    timings = []
    for i in range(steps + 1):
        started = time.perf_counter()
        logits, existence = model(images)
        loss, _ = criterion(logits, existence, masks, exist)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i:  # the first step warms allocator and kernels
            timings.append(time.perf_counter() - started)
    return sorted(timings)[len(timings) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--preset", default="tusimple")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = model_config(args.preset)
    ours = SCNN(config)
    baseline = copy.deepcopy(ours)
    baseline.message_passing = nn.Sequential(*(LoopMessagePassing(m) for m in baseline.message_passing))
    batch = (torch.randn(args.batch_size, 3, config.input_height, config.input_width),
             torch.randint(0, 5, (args.batch_size, config.input_height, config.input_width)),
             torch.randint(0, 2, (args.batch_size, 4)).float())
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(batch[0])[0], baseline.eval()(batch[0])[0], rtol=1e-4, atol=1e-4)
    ours.train()
    baseline.train()
    # Alternate to spread machine noise over both.
    base_t, ours_t = [], []
    for _ in range(2):
        base_t.append(step_seconds(baseline, batch, args.steps))
        ours_t.append(step_seconds(ours, batch, args.steps))
    base_s, ours_s = min(base_t), min(ours_t)
    print("baseline: the same network and weights with textbook message passing (a Python loop over slices, "
          "each slice's conv added to the next, torch.cat at the end); best of 2 alternating runs each")
    print(f"preset {args.preset} at {config.input_width}x{config.input_height}, batch {args.batch_size}, "
          f"{torch.get_num_threads()} threads")
    print(f"per-slice loop message passing : {base_s * 1000:8.0f} ms/step")
    print(f"laneflow message passing       : {ours_s * 1000:8.0f} ms/step")
    print(f"ratio                          : {base_s / ours_s:8.2f}x  (target >= 1.0x)")


if __name__ == "__main__":
    main()
