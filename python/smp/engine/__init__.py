"""The engine: parallelize() turns a module into this rank's part; Engine runs it step by step."""

from smp.engine.engine import Engine
from smp.engine.parallelize import Parallelized, parallelize, place_whole
from smp.engine.protocol import GradientConsumer

__all__ = ["Engine", "GradientConsumer", "Parallelized", "parallelize", "place_whole"]
