mod data_parallel;
mod fsdp;
mod pretrain;
