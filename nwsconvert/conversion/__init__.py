"""Turning a model into an NWS model: the conversion config, the planner (one decision per
layer), the converter that applies a plan, the torch.fx graph analysis that finds each layer's
role, and the printable conversion report."""
