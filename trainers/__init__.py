"""The trainers that run on the ranks: `pretrain` (torchrun -m trainers.pretrain) and
`posttrain` (the TRL trainers, torchrun -m trainers.posttrain)."""
