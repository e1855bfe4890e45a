"""megatron_iiet.commands.train_tokenizer as a script; also installed as `iiet-train-tokenizer`."""

from megatron_iiet.commands.train_tokenizer import main

if __name__ == "__main__":
    main()
