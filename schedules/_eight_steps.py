"""The eight steps of DeepSeek's DualPipe `step()` (deepseek-ai/DualPipe:dualpipe/dualpipe.py), shared by the
DualPipe and DualPipeV generators. They differ only in H, h, C and which stages a rank's two chunks are.

Notation of the reference: chunk "0" is the rank's chunk whose input source is nearer, chunk "1" the other;
H = half the ranks (DualPipe) or all ranks (DualPipeV); h = min(r, P-1-r) (DualPipe) or r (DualPipeV);
C = micro-batches per chunk. F0/F1 forward, B1/B0 full backward, I1/I0 input-grad backward (its W is queued),
W pops the oldest queued weight-grad, (F0&B1) an overlapped forward/backward pair.

    step 1  nF0        2(H-h-1) x  F0
    step 2  nF0F1      (h+1)    x  F0 F1
    step 3  nB1W1F1    (H-h-1)  x  I1 W F1                      zero-bubble: W fills the gap
    step 4  nF0B1F1B0  (C-2H+h+1) x (F0&B1) (F1&B0)              main overlapped loop
    step 5  nB1F1B0    (H-h-1)  x  B1 (F1&B0)
    step 6  nB1B0      (h+1)    x  B1 B0, split (I) from iteration (h+1)//2 on
    step 7  nWB0       (H-h-1)  x  W I0
    step 8  nW         (h+1)    x  W
"""
from __future__ import annotations

from collections import deque

from schedules.ir import Action, Kind


def eight_steps(H: int, h: int, C: int, stage0: int, stage1: int, first_pair_unoverlapped: bool) -> list[Action]:
    acts: list[Action] = []
    next_f = {stage0: 0, stage1: 0}
    next_b = {stage0: 0, stage1: 0}
    w_queue: deque[tuple[int, int]] = deque()

    new = tuple.__new__  # NamedTuple construction without its Python-level __new__ (10^5 actions per schedule)

    def forward(stage: int) -> Action:
        a = new(Action, (Kind.F, stage, next_f[stage], -1, -1, -1))
        next_f[stage] += 1
        return a

    def backward(stage: int, split: bool) -> Action:
        mb = next_b[stage]
        next_b[stage] += 1
        if split:
            w_queue.append((stage, mb))
            return new(Action, (Kind.I, stage, mb, -1, -1, -1))
        return new(Action, (Kind.B, stage, mb, -1, -1, -1))

    def weight() -> Action:
        stage, mb = w_queue.popleft()
        return Action(Kind.W, stage, mb)

    def overlapped(f_stage: int, b_stage: int) -> Action:
        f = forward(f_stage)
        b = backward(b_stage, split=False)
        return new(Action, (Kind.FB, f[1], f[2], b[1], b[2], -1))

    for _ in range(2 * (H - h - 1)):  # step 1
        acts.append(forward(stage0))
    for _ in range(h + 1):  # step 2
        acts.append(forward(stage0))
        acts.append(forward(stage1))
    for _ in range(H - h - 1):  # step 3
        acts.append(backward(stage1, split=True))
        acts.append(weight())
        acts.append(forward(stage1))
    for i in range(C - 2 * H + h + 1):  # step 4
        if i == 0 and first_pair_unoverlapped:
            acts.append(forward(stage0))
            acts.append(backward(stage1, split=False))
        else:
            acts.append(overlapped(stage0, stage1))
        acts.append(overlapped(stage1, stage0))
    for _ in range(H - h - 1):  # step 5
        acts.append(backward(stage1, split=False))
        acts.append(overlapped(stage1, stage0))
    step_6 = h + 1
    split = False
    for i in range(step_6):  # step 6
        if i == step_6 // 2 and h % 2 == 1:
            split = True
        acts.append(backward(stage1, split))
        if i == step_6 // 2 and h % 2 == 0:
            split = True
        acts.append(backward(stage0, split))
    for _ in range(H - h - 1):  # step 7
        acts.append(weight())
        acts.append(backward(stage0, split=True))
    for _ in range(h + 1):  # step 8
        acts.append(weight())
    if w_queue:
        raise AssertionError(f"eight_steps left {len(w_queue)} weight-grads queued (H={H}, h={h}, C={C})")
    return acts
