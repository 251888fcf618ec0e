"""Imported once by the harness's fork server: does before forking what every rank would
otherwise pay for on its own (seconds on 2 cores): the first optimizer step and the first
torch.export import what they need. Starts no thread (forking copies none)."""

import threading

import torch

_p = torch.nn.Parameter(torch.zeros(2))
_p.grad = torch.ones(2)
torch.optim.Adam([_p]).step()
torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),), strict=False)
assert threading.active_count() == 1, threading.enumerate()
