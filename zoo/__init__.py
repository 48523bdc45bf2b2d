"""nwsconvert.zoo: architecture presets, task suites, recipes and pretrained-pool entries.

Filled by the trainer and zoo issues; empty for now.
"""

__all__: list[str] = []
