"""The run's extra pip packages.

* :mod:`fsm.extras.installer`: the allow-list, the chooser (uv when it is there, else
  pip) and the install itself, bounded and classified;
* :mod:`fsm.extras.pip`: pip's and uv's command lines and how their failures read.

This package imports nothing itself.
"""
