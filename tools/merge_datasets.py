"""megatron_iiet.commands.merge_datasets as a script; also installed as `iiet-merge-datasets`."""

from megatron_iiet.commands.merge_datasets import main

if __name__ == "__main__":
    main()
