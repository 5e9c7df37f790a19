import argparse
import numpy as np
import torch

np.random.seed(2)

T = 20
parser = argparse.ArgumentParser()
parser.add_argument('--length', type=int, default=1000, help='samples per wave')
parser.add_argument('--waves', type=int, default=100)
args = parser.parse_args()
L = args.length
N = args.waves

x = np.empty((N, L), 'int64')
x[:] = np.array(range(L)) + np.random.randint(-4 * T, 4 * T, N).reshape(N, 1)
data = np.sin(x / 1.0 / T).astype('float64')
torch.save(torch.from_numpy(data), open('traindata.pt', 'wb'))  # a tensor: torch.load's weights_only
