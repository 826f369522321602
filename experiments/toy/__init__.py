"""Toy sequence-task training experiment: tasks, model, training loop."""
