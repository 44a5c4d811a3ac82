//! Mixture-of-experts building blocks: where routed rows go over the expert axis
//! ([`ExpertRoute`], the local halves of
//! [`FusedOps::expert_dispatch`](crate::FusedOps::expert_dispatch) and
//! [`FusedOps::expert_combine`](crate::FusedOps::expert_combine)), and the grouped matmul the
//! experts run as ([`FusedOps::grouped_matmul`](crate::FusedOps::grouped_matmul)).
//!
//! A rank sorts its routed rows by expert (`counts[e]` rows for expert `e`, experts in order).
//! The `E` experts are split over the `m` members of the expert axis in contiguous runs: member
//! `j` holds experts `j·E/m .. (j+1)·E/m`. Dispatch sends each member the rows of its experts
//! (an all-to-all with variable splits) and regroups what arrives (member by member, each's
//! rows by expert) expert by expert: the rows of the member's first expert (member 0's, then
//! member 1's, …), then its second's, and so on — every expert's rows consecutive, no padding,
//! so the experts run as one grouped matmul of exactly the rows they received (dropless MoE
//! without a capacity's waste, as MegaBlocks and grouped GEMMs do). Combine is dispatch's
//! adjoint: the rows back in received order, home over the all-to-all with the splits swapped.
//!
//! Without expert parallelism (`m = 1`) nothing travels and the rows are grouped already.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Int, Shape, Tensor, TensorData, TensorMetadata};

/// Where one batch of routed rows goes over the expert axis, known to every member alike (the
/// counts are gathered over the axis before dispatch).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertRoute {
    /// Members of the expert axis (1 without expert parallelism).
    pub members: usize,
    /// This rank's index on the expert axis.
    pub index: usize,
    /// Experts in all, a multiple of `members`.
    pub experts: usize,
    /// `counts[i · experts + e]`: the rows member `i` routes to expert `e`.
    pub counts: Vec<usize>,
}

impl ExpertRoute {
    /// The route of `counts` (every member's, member-major) over `members` members, this rank
    /// at `index`.
    ///
    /// # Panics
    /// When `experts` is not a multiple of `members` or `counts` does not hold
    /// `members · experts` entries (the model checks both before routing).
    pub fn new(members: usize, index: usize, experts: usize, counts: Vec<usize>) -> Self {
        assert!(
            members > 0 && experts.is_multiple_of(members) && index < members,
            "{experts} experts over {members} members (index {index})"
        );
        assert_eq!(
            counts.len(),
            members * experts,
            "one count per member and expert"
        );
        Self {
            members,
            index,
            experts,
            counts,
        }
    }

    /// Experts each member holds.
    pub fn local(&self) -> usize {
        self.experts / self.members
    }

    /// The experts member `j` holds.
    pub fn held(&self, j: usize) -> std::ops::Range<usize> {
        j * self.local()..(j + 1) * self.local()
    }

    /// Rows this rank sends each member (its rows for that member's experts).
    pub fn send(&self) -> Vec<usize> {
        let mine = &self.counts[self.index * self.experts..][..self.experts];
        (0..self.members)
            .map(|j| self.held(j).map(|e| mine[e]).sum())
            .collect()
    }

    /// Rows this rank receives from each member (that member's rows for this rank's experts).
    pub fn recv(&self) -> Vec<usize> {
        (0..self.members)
            .map(|i| {
                self.held(self.index)
                    .map(|e| self.counts[i * self.experts + e])
                    .sum()
            })
            .collect()
    }

    /// Rows each of this rank's experts receives from every member: the grouped matmul's
    /// groups.
    pub fn groups(&self) -> Vec<usize> {
        self.held(self.index)
            .map(|e| {
                (0..self.members)
                    .map(|i| self.counts[i * self.experts + e])
                    .sum()
            })
            .collect()
    }

    /// Rows this rank receives in all.
    pub fn received_rows(&self) -> usize {
        self.recv().iter().sum()
    }

    /// For each row of the grouped order (expert by expert, each's rows member by member), its
    /// index in the received order (member by member, each's rows expert by expert).
    pub fn grouped_order(&self) -> Vec<usize> {
        // Where each (member, local expert) run starts in the received order.
        let local = self.local();
        let mut start = vec![0usize; self.members * local];
        let mut at = 0;
        for i in 0..self.members {
            for (l, e) in self.held(self.index).enumerate() {
                start[i * local + l] = at;
                at += self.counts[i * self.experts + e];
            }
        }
        let mut order = Vec::with_capacity(at);
        for (l, e) in self.held(self.index).enumerate() {
            for i in 0..self.members {
                let n = self.counts[i * self.experts + e];
                order.extend(start[i * local + l]..start[i * local + l] + n);
            }
        }
        order
    }
}

fn indices<B: Backend>(v: &[usize], device: &B::Device) -> burn::tensor::ops::IntTensor<B> {
    let v: Vec<i64> = v.iter().map(|&i| i as i64).collect();
    let n = v.len();
    Tensor::<B, 1, Int>::from_data(TensorData::new(v, [n]), device).into_primitive()
}

/// The received rows `[rows, d]` (member by member) in the grouped order (expert by expert).
pub fn regroup<B: Backend>(received: FloatTensor<B>, route: &ExpertRoute) -> FloatTensor<B> {
    if route.members == 1 || received.shape()[0] == 0 {
        return received;
    }
    let device = B::float_device(&received);
    B::float_select(received, 0, indices::<B>(&route.grouped_order(), &device))
}

/// The adjoint of [`regroup`]: grouped rows back in the received order.
pub fn ungroup<B: Backend>(grouped: FloatTensor<B>, route: &ExpertRoute) -> FloatTensor<B> {
    if route.members == 1 || grouped.shape()[0] == 0 {
        return grouped;
    }
    let order = route.grouped_order();
    let mut inverse = vec![0; order.len()];
    for (j, &r) in order.iter().enumerate() {
        inverse[r] = j;
    }
    let device = B::float_device(&grouped);
    B::float_select(grouped, 0, indices::<B>(&inverse, &device))
}

/// `w [groups, k, n]`'s matrix `l`, `[k, n]`.
fn matrix<B: Backend>(w: &FloatTensor<B>, l: usize) -> FloatTensor<B> {
    let s = w.shape();
    let one = B::float_slice(
        w.clone(),
        &[
            burn::tensor::Slice::from(l..l + 1),
            burn::tensor::Slice::from(0..s[1]),
            burn::tensor::Slice::from(0..s[2]),
        ],
    );
    B::float_reshape(one, Shape::new([s[1], s[2]]))
}

/// Rows `start..start + n` of `x`.
fn rows<B: Backend>(x: &FloatTensor<B>, start: usize, n: usize) -> FloatTensor<B> {
    let cols = x.shape()[1];
    B::float_slice(
        x.clone(),
        &[
            burn::tensor::Slice::from(start..start + n),
            burn::tensor::Slice::from(0..cols),
        ],
    )
}

/// The grouped matmul: rows `x [rows, k]` in runs of `groups[l]` (summing to `rows`), run `l`
/// times `w[l]` (`w [groups, k, n]`): `[rows, n]`. One matmul per non-empty group.
pub fn grouped_matmul<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    groups: &[usize],
) -> FloatTensor<B> {
    let n = w.shape()[2];
    let device = B::float_device(&x);
    let dtype = x.dtype().into();
    let mut start = 0;
    let mut parts = Vec::new();
    for (l, &count) in groups.iter().enumerate() {
        if count > 0 {
            parts.push(B::float_matmul(
                rows::<B>(&x, start, count),
                matrix::<B>(&w, l),
            ));
        }
        start += count;
    }
    if parts.is_empty() {
        return B::float_zeros(Shape::new([0, n]), &device, dtype);
    }
    B::float_cat(parts, 0)
}

/// The gradients of [`grouped_matmul`]: `dx` (run `l` of `dy` times `w[l]ᵀ`) and `dw` (`w[l]`'s:
/// run `l` of `x`, transposed, times run `l` of `dy`; zeros for an empty group).
pub fn grouped_matmul_backward<B: Backend>(
    x: FloatTensor<B>,
    w: FloatTensor<B>,
    dy: FloatTensor<B>,
    groups: &[usize],
) -> (FloatTensor<B>, FloatTensor<B>) {
    let [_, k, n] = w.shape().dims();
    let device = B::float_device(&dy);
    let dtype = dy.dtype().into();
    let mut start = 0;
    let (mut dx, mut dw) = (Vec::new(), Vec::new());
    for (l, &count) in groups.iter().enumerate() {
        let g = if count > 0 {
            let (xl, dyl) = (rows::<B>(&x, start, count), rows::<B>(&dy, start, count));
            dx.push(B::float_matmul(
                dyl.clone(),
                B::float_transpose(matrix::<B>(&w, l)),
            ));
            B::float_matmul(B::float_transpose(xl), dyl)
        } else {
            B::float_zeros(Shape::new([k, n]), &device, dtype)
        };
        dw.push(B::float_reshape(g, Shape::new([1, k, n])));
        start += count;
    }
    let dx = if dx.is_empty() {
        B::float_zeros(Shape::new([0, k]), &device, dtype)
    } else {
        B::float_cat(dx, 0)
    };
    (dx, B::float_cat(dw, 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorPrimitive;

    /// Two members, four experts: member 0 routes (1, 2 | 0, 3) rows, member 1 (2, 0 | 1, 1).
    fn route(index: usize) -> ExpertRoute {
        ExpertRoute::new(2, index, 4, vec![1, 2, 0, 3, 2, 0, 1, 1])
    }

    fn float<const D: usize>(t: FloatTensor<Flex>) -> Vec<f32> {
        Tensor::<Flex, D>::from_primitive(TensorPrimitive::Float(t))
            .into_data()
            .into_vec()
            .unwrap()
    }

    fn tensor<const D: usize>(v: Vec<f32>, shape: [usize; D]) -> FloatTensor<Flex> {
        let t = Tensor::<Flex, D>::from_data(TensorData::new(v, shape), &Default::default());
        t.into_primitive().tensor()
    }

    #[test]
    fn splits_and_groups_follow_the_counts() {
        let (a, b) = (route(0), route(1));
        assert_eq!(a.send(), vec![3, 3]);
        assert_eq!(b.send(), vec![2, 2]);
        // Member i's send[j] is member j's recv[i].
        assert_eq!(a.recv(), vec![3, 2]);
        assert_eq!(b.recv(), vec![3, 2]);
        assert_eq!(a.groups(), vec![3, 2]);
        assert_eq!(b.groups(), vec![1, 4]);
        // Member 1 receives: from 0, expert 3's three rows (0, 1, 2); from 1, expert 2's row
        // (3) and expert 3's (4). Grouped: expert 2's row, then expert 3's four.
        assert_eq!(b.grouped_order(), vec![3, 0, 1, 2, 4]);
        assert_eq!(a.grouped_order(), vec![0, 3, 4, 1, 2]);
    }

    #[test]
    fn ungroup_undoes_regroup() {
        let r = route(1);
        let n = r.received_rows();
        let rows: Vec<f32> = (0..n * 2).map(|v| v as f32).collect();
        let grouped = regroup::<Flex>(tensor(rows.clone(), [n, 2]), &r);
        let g = float::<2>(grouped.clone());
        assert_eq!(&g[..2], &[6.0, 7.0], "expert 2's one row first");
        assert_eq!(float::<2>(ungroup::<Flex>(grouped, &r)), rows);
    }

    /// The grouped matmul and its gradients equal per-group matmuls written out, an empty group
    /// included (its weight's gradient zero).
    #[test]
    fn grouped_matmul_is_one_matmul_per_group() {
        let (k, n, groups) = (3, 2, [2usize, 0, 3]);
        let rows: usize = groups.iter().sum();
        let xv: Vec<f32> = (0..rows * k).map(|v| (v as f32 * 0.37).sin()).collect();
        let wv: Vec<f32> = (0..3 * k * n).map(|v| (v as f32 * 0.91).cos()).collect();
        let dyv: Vec<f32> = (0..rows * n).map(|v| (v as f32 * 0.53).sin()).collect();
        let y = float::<2>(grouped_matmul::<Flex>(
            tensor(xv.clone(), [rows, k]),
            tensor(wv.clone(), [3, k, n]),
            &groups,
        ));
        let (dx, dw) = grouped_matmul_backward::<Flex>(
            tensor(xv.clone(), [rows, k]),
            tensor(wv.clone(), [3, k, n]),
            tensor(dyv.clone(), [rows, n]),
            &groups,
        );
        let (dx, dw) = (float::<2>(dx), float::<3>(dw));
        let group_of = |r: usize| if r < 2 { 0 } else { 2 };
        for r in 0..rows {
            let g = group_of(r);
            for j in 0..n {
                let want: f32 = (0..k)
                    .map(|i| xv[r * k + i] * wv[g * k * n + i * n + j])
                    .sum();
                assert!((y[r * n + j] - want).abs() < 1e-6, "y[{r}, {j}]");
            }
            for i in 0..k {
                let want: f32 = (0..n)
                    .map(|j| dyv[r * n + j] * wv[g * k * n + i * n + j])
                    .sum();
                assert!((dx[r * k + i] - want).abs() < 1e-6, "dx[{r}, {i}]");
            }
        }
        for g in 0..3 {
            for i in 0..k {
                for j in 0..n {
                    let want: f32 = (0..rows)
                        .filter(|&r| group_of(r) == g)
                        .map(|r| xv[r * k + i] * dyv[r * n + j])
                        .sum();
                    let got = dw[g * k * n + i * n + j];
                    assert!(
                        (got - want).abs() < 1e-6,
                        "dw[{g}, {i}, {j}]: {got} vs {want}"
                    );
                }
            }
        }
    }
}
