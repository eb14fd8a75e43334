"""The tiny-target tool's choices that a rebuild depends on."""

from dflash_ddp.tools.make_tiny_target import cpu_multiplies_bf16, parse_args, resolve_autocast


def test_bf16_autocast_follows_the_cpu_unless_told_and_the_recorded_command_names_the_choice():
    # without bf16 instructions torch's bf16 products are tens of times slower than fp32: auto trains in fp32
    # there; the recorded command states the choice, so that it rebuilds the same weights on any CPU
    native = cpu_multiplies_bf16()
    for flags, expected in (([], native), (["--bf16_autocast", "on"], True), (["--no_bf16_autocast"], False)):
        argv = ["--out_dir", "x", "--train_steps", "3", *flags]
        args = parse_args(argv)
        command = resolve_autocast(args, " ".join(argv))
        assert args.bf16_autocast is expected, flags
        assert command == f"--out_dir x --train_steps 3 --bf16_autocast {'on' if expected else 'off'}", flags
        again = parse_args(command.split())
        resolve_autocast(again, command)
        assert again.bf16_autocast is expected, command
