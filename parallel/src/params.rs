//! Walks over a module's float parameters that know each one's path (`blocks.0.attn.c_attn.weight`),
//! and their fallible forms: a walk that fails at one parameter stops there and returns the
//! error, so no visitor keeps an error slot of its own.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// The module path while a visitor or mapper walks a module (`enter_module` / `exit_module`):
/// the names Burn reports, joined with dots (`blocks.0.attn.c_attn.weight`).
#[derive(Clone, Debug, Default)]
pub struct ModulePath(Vec<String>);

impl ModulePath {
    /// Entering a submodule or parameter field.
    pub fn enter(&mut self, name: &str) {
        self.0.push(name.to_string());
    }

    /// Leaving it.
    pub fn exit(&mut self) {
        self.0.pop();
    }

    /// The current path, dot-joined.
    pub fn name(&self) -> String {
        self.0.join(".")
    }

    /// The path split into (enclosing module, last segment).
    pub fn split_last(&self) -> (String, String) {
        match self.0.split_last() {
            Some((last, module)) => (module.join("."), last.clone()),
            None => (String::new(), String::new()),
        }
    }
}

/// A walk over a module's float parameters that is told each one's path.
pub trait ParamVisitor<B: Backend> {
    /// One parameter, at `path`.
    fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>);
}

/// A map over a module's float parameters that is told each one's path.
pub trait ParamMapper<B: Backend> {
    /// One parameter, at `path`: what it becomes.
    fn map<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>>;
}

/// Burn's visitor and mapper, keeping the path for a [`ParamVisitor`] or [`ParamMapper`].
struct WithPaths<'a, V> {
    path: ModulePath,
    inner: &'a mut V,
}

impl<B: Backend, V: ParamVisitor<B>> ModuleVisitor<B> for WithPaths<'_, V> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.inner.visit(&self.path, param);
    }
}

impl<B: Backend, V: ParamMapper<B>> ModuleMapper<B> for WithPaths<'_, V> {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.enter(name);
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.exit();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        self.inner.map(&self.path, param)
    }
}

/// Walk `module`'s float parameters in visiting order, with their paths.
pub fn visit_params<B: Backend, M: Module<B>>(module: &M, visitor: &mut impl ParamVisitor<B>) {
    module.visit(&mut WithPaths {
        path: ModulePath::default(),
        inner: visitor,
    });
}

/// Map `module`'s float parameters in visiting order, with their paths.
pub fn map_params<B: Backend, M: Module<B>>(module: M, mapper: &mut impl ParamMapper<B>) -> M {
    module.map(&mut WithPaths {
        path: ModulePath::default(),
        inner: mapper,
    })
}

/// What [`TryParamMapper::try_map`] gives: the parameter as it becomes, or why not with the
/// parameter given back as it was.
pub type Mapped<B, const D: usize, E> = Result<Param<Tensor<B, D>>, (E, Param<Tensor<B, D>>)>;

/// `param` with its value through `f`, its id and mapper kept; when `f` fails, the error with
/// the parameter as it was (see [`Mapped`]). The parameter is consumed (a lazy one made) first.
pub fn map_value<B: Backend, const D: usize, E>(
    param: Param<Tensor<B, D>>,
    f: impl FnOnce(&Tensor<B, D>) -> Result<Tensor<B, D>, E>,
) -> Mapped<B, D, E> {
    let (id, tensor, mapper) = param.consume();
    match f(&tensor) {
        Ok(out) => Ok(Param::from_mapped_value(id, out, mapper)),
        Err(e) => Err((e, Param::from_mapped_value(id, tensor, mapper))),
    }
}

/// A fallible [`ParamMapper`]: each parameter becomes something else or the walk fails.
pub trait TryParamMapper<B: Backend> {
    /// Why a parameter could not be mapped.
    type Error;

    /// One parameter, at `path`: what it becomes, or why not — with the parameter given back
    /// (as it was), so that the module stays whole while the error travels up. [`map_value`]
    /// does both for a map of the value alone.
    fn try_map<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Mapped<B, D, Self::Error>;
}

/// A fallible [`ParamVisitor`].
pub trait TryParamVisitor<B: Backend> {
    /// Why a parameter failed the walk.
    type Error;

    /// One parameter, at `path`.
    fn try_visit<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: &Param<Tensor<B, D>>,
    ) -> Result<(), Self::Error>;
}

/// The first error of a fallible walk; the parameters after it are passed over.
struct FirstError<'a, T, E> {
    inner: &'a mut T,
    error: Option<E>,
}

impl<B: Backend, T: TryParamMapper<B>> ParamMapper<B> for FirstError<'_, T, T::Error> {
    fn map<const D: usize>(
        &mut self,
        path: &ModulePath,
        param: Param<Tensor<B, D>>,
    ) -> Param<Tensor<B, D>> {
        if self.error.is_some() {
            return param;
        }
        self.inner
            .try_map(path, param)
            .unwrap_or_else(|(e, param)| {
                self.error = Some(e);
                param
            })
    }
}

impl<B: Backend, T: TryParamVisitor<B>> ParamVisitor<B> for FirstError<'_, T, T::Error> {
    fn visit<const D: usize>(&mut self, path: &ModulePath, param: &Param<Tensor<B, D>>) {
        if self.error.is_none()
            && let Err(e) = self.inner.try_visit(path, param)
        {
            self.error = Some(e);
        }
    }
}

/// Map `module`'s float parameters in visiting order, with their paths, until one fails: then
/// that error (the module is dropped).
pub fn try_map_params<B: Backend, M: Module<B>, T: TryParamMapper<B>>(
    module: M,
    mapper: &mut T,
) -> Result<M, T::Error> {
    let mut walk = FirstError {
        inner: mapper,
        error: None,
    };
    let module = map_params(module, &mut walk);
    match walk.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

/// Walk `module`'s float parameters in visiting order, with their paths, until one fails: then
/// that error.
pub fn try_visit_params<B: Backend, M: Module<B>, T: TryParamVisitor<B>>(
    module: &M,
    visitor: &mut T,
) -> Result<(), T::Error> {
    let mut walk = FirstError {
        inner: visitor,
        error: None,
    };
    visit_params(module, &mut walk);
    walk.error.map_or(Ok(()), Err)
}
