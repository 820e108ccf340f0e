"""``python -m tq_plugin.demo``: the data-plane walkthrough in :mod:`tq_plugin.lightning.demo.one_step`."""

from tq_plugin.lightning.demo.one_step import main

if __name__ == "__main__":
    main()
