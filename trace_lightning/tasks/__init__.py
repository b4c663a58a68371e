"""Tasks: what an agent does, behind ``base.Task`` and ``base.TaskData``; search QA and
arithmetic with a calculator."""
