mod data_parallel;
