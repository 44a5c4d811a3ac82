mod data_parallel;
mod pretrain;
