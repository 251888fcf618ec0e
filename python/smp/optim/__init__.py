"""Optimizer machinery: flat (ZeRO-1) state and fp32 masters, loss scaling, global clipping."""
