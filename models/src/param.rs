//! Trainable parameters and how a model's constructor creates them in order, drawing the
//! random ones from one seeded stream (so a seed fixes every initial weight). The
//! initialisations are PyTorch Geometric's, so that a model starts where the PyG model users
//! compare against starts: `Linear` weights and biases U(±1/√fan_in) (SAGE, MLP, ResSAGE+),
//! GCN's weight Glorot-uniform with a zero bias. (Glorot everywhere made SAGE's first logits
//! about 3x too large, and its training stalled at the class prior for tens of epochs.)

use grandis_engine::{Backend, Result};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A trainable tensor with its gradient and Adam moments (all on the backend).
pub struct Param<B: Backend> {
    pub name: String,
    pub shape: Vec<usize>,
    pub value: B::Buf,
    pub grad: B::Buf,
    pub m: B::Buf,
    pub v: B::Buf,
}

impl<B: Backend> Param<B> {
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A model's parameters as a list of names, shapes and initialisations, in creation order;
/// stage `s`'s are named `stage{s}.<name>`. Known without a backend (checkpoints are checked
/// against it before any model is built); [`ParamLayout::materialize`] creates them.
pub(crate) struct ParamLayout {
    layer_norm: bool,
    pub specs: Vec<ParamSpec>,
}

/// One parameter of a [`ParamLayout`].
pub(crate) struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    init: Init,
}

#[derive(Clone, Copy)]
enum Init {
    /// U(±√(6 / (fan_in + fan_out))), the fans being the last two dimensions (PyG's `glorot`
    /// of a stack of matrices).
    Glorot,
    /// U(±1/√fan_in): PyTorch's `Linear` default for weights (Kaiming-uniform with a = √5)
    /// and biases.
    FanIn(usize),
    Zeros,
    Ones,
}

impl ParamLayout {
    /// An empty layout; `layer_norm` says whether [`Self::norm`] adds LayerNorm parameters.
    pub fn new(layer_norm: bool) -> Self {
        ParamLayout {
            layer_norm,
            specs: Vec::new(),
        }
    }

    fn add(&mut self, name: String, shape: Vec<usize>, init: Init) -> usize {
        self.specs.push(ParamSpec { name, shape, init });
        self.specs.len() - 1
    }

    /// A `d_in x d_out` weight of stage `s` initialised like PyTorch's `Linear`.
    pub fn linear(&mut self, s: usize, name: &str, d_in: usize, d_out: usize) -> usize {
        self.add(
            format!("stage{s}.{name}"),
            vec![d_in, d_out],
            Init::FanIn(d_in),
        )
    }

    /// A Glorot-initialised `d_in x d_out` weight of stage `s` (GCN's and GAT's).
    pub fn glorot(&mut self, s: usize, name: &str, d_in: usize, d_out: usize) -> usize {
        self.add(format!("stage{s}.{name}"), vec![d_in, d_out], Init::Glorot)
    }

    /// The bias of `d_out` values of a stage `s` whose weights read `d_in` inputs, initialised
    /// like PyTorch's `Linear`.
    pub fn bias(&mut self, s: usize, d_out: usize, d_in: usize) -> usize {
        self.add(format!("stage{s}.bias"), vec![d_out], Init::FanIn(d_in))
    }

    /// `count` Glorot-initialised `d_in x d_out` matrices of stage `s` in one tensor
    /// (`count x d_in x d_out`: RGCN's bases).
    pub fn glorot_stack(
        &mut self,
        s: usize,
        name: &str,
        count: usize,
        d_in: usize,
        d_out: usize,
    ) -> usize {
        self.add(
            format!("stage{s}.{name}"),
            vec![count, d_in, d_out],
            Init::Glorot,
        )
    }

    /// [`Self::bias`] under another name in stage `s` (a relation's, `{key}.bias`).
    pub fn named_bias(&mut self, s: usize, name: &str, d_out: usize, d_in: usize) -> usize {
        self.add(format!("stage{s}.{name}"), vec![d_out], Init::FanIn(d_in))
    }

    /// A zero bias of `d` values for stage `s` (GCN's).
    pub fn zero_bias(&mut self, s: usize, d: usize) -> usize {
        self.named_zero_bias(s, "bias", d)
    }

    /// A zero bias of `d` values named `name` in stage `s` (a relation's, in R-GAT).
    pub fn named_zero_bias(&mut self, s: usize, name: &str, d: usize) -> usize {
        self.add(format!("stage{s}.{name}"), vec![d], Init::Zeros)
    }

    /// LayerNorm gain (ones) and shift (zeros) of width `d` for stage `s`, when the model has
    /// LayerNorm; `(None, None)` otherwise.
    pub fn norm(&mut self, s: usize, d: usize) -> (Option<usize>, Option<usize>) {
        if !self.layer_norm {
            return (None, None);
        }
        (
            Some(self.add(format!("stage{s}.ln_gamma"), vec![d], Init::Ones)),
            Some(self.add(format!("stage{s}.ln_beta"), vec![d], Init::Zeros)),
        )
    }

    /// Creates the parameters on `b`, drawing the random ones in order from one stream seeded
    /// by `seed`.
    pub fn materialize<B: Backend>(&self, b: &B, seed: u64) -> Result<Vec<Param<B>>> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x6d6f_6465_6c73);
        self.specs
            .iter()
            .map(|spec| {
                let shape = &spec.shape;
                let len: usize = shape.iter().product();
                let host: Vec<f32> = match spec.init {
                    Init::Glorot => {
                        let fans = shape[shape.len() - 2] + shape[shape.len() - 1];
                        let limit = (6.0 / fans as f64).sqrt() as f32;
                        (0..len).map(|_| rng.gen_range(-limit..limit)).collect()
                    }
                    Init::FanIn(fan_in) => {
                        let limit = (1.0 / (fan_in.max(1) as f64).sqrt()) as f32;
                        (0..len).map(|_| rng.gen_range(-limit..limit)).collect()
                    }
                    Init::Zeros => vec![0.0; len],
                    Init::Ones => vec![1.0; len],
                };
                Ok(Param {
                    name: spec.name.clone(),
                    shape: shape.clone(),
                    value: b.upload(&host)?,
                    grad: b.alloc(len)?,
                    m: b.alloc(len)?,
                    v: b.alloc(len)?,
                })
            })
            .collect()
    }
}

/// Two distinct elements of `v`, both mutable (a LayerNorm's gain and shift gradients).
pub(crate) fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert!(a != b, "distinct parameters");
    if a < b {
        let (l, r) = v.split_at_mut(b);
        (&mut l[a], &mut r[0])
    } else {
        let (l, r) = v.split_at_mut(a);
        (&mut r[0], &mut l[b])
    }
}
