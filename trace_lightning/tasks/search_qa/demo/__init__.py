"""The CPU demo: a generated multi-hop world, its corpus and questions, and a warm-started
tiny policy; what keeps it honest is in ``world.py``'s docstring."""

from trace_lightning.tasks.search_qa.demo.prepare import DEMO_INSTRUCTION, DemoPaths, prepare_demo
from trace_lightning.tasks.search_qa.demo.world import World, generate_world

__all__ = ["DEMO_INSTRUCTION", "DemoPaths", "World", "generate_world", "prepare_demo"]
