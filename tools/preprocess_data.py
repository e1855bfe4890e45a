"""megatron_iiet.commands.preprocess_data as a script; also installed as `iiet-preprocess-data`."""

from megatron_iiet.commands.preprocess_data import main

if __name__ == "__main__":
    main()
